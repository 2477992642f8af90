"""TensorFlow importer: a Keras model or a ``tf.function`` in, an :class:`~opsched.graph.OpGraph` out.

``from_keras(model, batch=1)`` and ``from_tf_function(fn, input_signature)``

1. trace the model / function into a *concrete function* with fully known
   input shapes (a fixed batch), so every tensor shape is static;
2. freeze it: variables become ``Const`` nodes
   (``convert_variables_to_constants_v2``, which also drops ``ReadVariableOp``);
3. simplify it with TensorFlow's own Grappler, restricted to the passes that
   remove bookkeeping without changing what is computed: ``constfold``
   (everything that depends only on weights is evaluated once - the
   ``var + eps -> rsqrt -> * gamma`` chain of an inference batch norm becomes
   one constant and is folded into the convolution filter where Grappler can,
   ``Shape``/``Size`` of static tensors become constants) and ``dependency``
   (``Identity``/``NoOp`` and redundant control edges go).  Grappler folds by
   *value*, exactly as it does when TensorFlow runs the model: a batch norm
   whose shift is zero (as in a ``weights=None`` model) loses its ``Add``;
4. reads the remaining graph: every node that depends on a graph input and is
   not a view (``Identity``, ``Reshape``, ``Squeeze``, ``ExpandDims``, ...:
   no arithmetic, no copy) becomes an :class:`~opsched.graph.Op` whose id is
   the TF node name, with its canonical kind, FLOPs from shapes, bytes read
   and written from tensor shapes and dtypes, parameter bytes (its constant
   inputs), output shape and dtype; each data input from another op becomes an
   :class:`~opsched.graph.Edge` carrying the tensor's bytes (views are looked
   through);
5. attaches a :class:`TFSource`: the simplified, frozen ``GraphDef`` as
   serialized protobuf bytes (weights inside as constants) plus the feed and
   fetch tensor names - what :class:`opsched.backends.tf_cpu.TFBackend` sends
   to its worker processes (no pickle, no user code).

FLOPs count a multiply-add as two: convolution ``2*N*Ho*Wo*Co*Kh*Kw*Ci/groups``,
matmul ``2*M*N*K``, elementwise one per output element, pooling one per
window element, reductions one per input element.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opsched.errors import ModelImportError
from opsched.graph import Edge, Op, OpGraph

# ----------------------------------------------------------------- op kinds
_KINDS: dict[str, tuple[str, ...]] = {
    "conv": ("Conv2D", "Conv3D", "Conv1D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
             "Conv3DBackpropInputV2", "_FusedConv2D", "_FusedDepthwiseConv2dNative"),
    "matmul": ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "_FusedMatMul",
               "_FusedBatchMatMulV2"),
    "pool": ("MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D", "FractionalMaxPool"),
    "norm": ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "_FusedBatchNormEx", "LRN",
             "Softmax", "LogSoftmax", "L2Loss"),
    "concat_split": ("ConcatV2", "Concat", "Split", "SplitV", "Pack", "Unpack", "Slice", "StridedSlice"),
    "reduce": ("Mean", "Sum", "Max", "Min", "Prod", "ArgMax", "ArgMin", "All", "Any", "EuclideanNorm"),
    "embedding": ("GatherV2", "Gather", "ResourceGather", "GatherNd", "SparseSegmentSum",
                  "SparseSegmentMean"),
    "rnn": ("LSTMBlockCell", "BlockLSTM", "BlockLSTMV2", "GRUBlockCell", "CudnnRNN", "CudnnRNNV3"),
}
_ELEMENTWISE = frozenset("""
    Abs Acos Acosh Add AddN AddV2 Asin Asinh Atan Atan2 Atanh BiasAdd Cast Ceil ClipByValue Cos Cosh
    Div DivNoNan Elu Equal Erf Erfc Exp Expm1 Floor FloorDiv FloorMod Gelu Greater GreaterEqual
    Inv IsFinite IsInf IsNan LeakyRelu Less LessEqual Log Log1p LogicalAnd LogicalNot LogicalOr
    Maximum Minimum Mod Mul MulNoNan Neg NotEqual Pow Reciprocal RealDiv Relu Relu6 Rint Round
    Rsqrt Select SelectV2 Selu Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Square SquaredDifference
    Sub Swish Tan Tanh TruncateDiv Xdivy Xlogy _FusedMish
""".split())
KIND_OF: dict[str, str] = {t: k for k, ts in _KINDS.items() for t in ts} | {t: "elementwise" for t in _ELEMENTWISE}

#: Ops with no arithmetic and no copy: the importer looks through them.
VIEW_OPS = frozenset({"Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient", "Reshape",
                      "Squeeze", "ExpandDims", "EnsureShape", "CheckNumerics", "NoOp", "PlaceholderWithDefault"})
#: Ops that produce no data a compute op needs (never ops of the graph).
_SKIP_OPS = frozenset({"NoOp", "Assert", "Print", "PrintV2"})


@dataclass(frozen=True)
class TensorInfo:
    """A graph input: feed tensor name, static shape, dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, eq=False)
class TFSource:
    """What a TensorFlow runtime needs to run an imported graph.

    ``graph_def`` is the serialized (protobuf) frozen, simplified GraphDef:
    weights are ``Const`` nodes inside it, so it is self-contained and safe to
    ship to another process.  ``inputs`` are the feeds (placeholder tensors),
    ``outputs`` the fetches; ``op_nodes`` maps every op id of the OpGraph to
    its TF node (today the same name).  ``keras_config`` is the model's JSON
    config when it came from Keras (for reference; the runtime does not use it).
    """

    graph_def: bytes
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[str, ...]
    op_nodes: tuple[str, ...]
    keras_config: str | None = field(default=None, repr=False)

    def random_inputs(self, seed: int = 0) -> list[np.ndarray]:
        """Deterministic inputs of the right shapes and dtypes (standard normal for floats)."""
        rng = np.random.default_rng(seed)
        out = []
        for t in self.inputs:
            dt = np.dtype(t.dtype)
            if np.issubdtype(dt, np.floating):
                out.append(rng.standard_normal(t.shape).astype(dt))
            elif np.issubdtype(dt, np.integer):
                out.append(rng.integers(0, 2, size=t.shape).astype(dt))
            else:
                out.append(np.zeros(t.shape, dtype=dt))
        return out

    def graph_def_proto(self) -> Any:
        from tensorflow.core.framework import graph_pb2

        gd = graph_pb2.GraphDef()  # pyright: ignore[reportAttributeAccessIssue] - generated protobuf, no stubs
        gd.ParseFromString(self.graph_def)
        return gd


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelImportError(
            f"the TensorFlow importer needs tensorflow (pip install -e '.[tf]'): {exc}"
        ) from None
    return tf


# ------------------------------------------------------------------ public API
def from_keras(model: Any, batch: int = 1, name: str | None = None) -> OpGraph:
    """Import a Keras model (functional, sequential or subclassed, already built).

    The model is called with ``training=False`` on inputs of its own shapes with
    the batch dimension set to ``batch``.
    """
    tf = _tf()
    if not hasattr(model, "inputs") or not callable(model):
        raise ModelImportError(f"from_keras: expected a built Keras model, got {type(model).__name__}")
    if not isinstance(batch, int) or batch < 1:
        raise ModelImportError(f"from_keras: batch must be a positive int, got {batch!r}")
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError) as exc:
        raise ModelImportError(f"from_keras: model {getattr(model, 'name', '?')!r} is not built ({exc}); "
                               "call it once or give it an Input") from None
    specs = []
    for i, t in enumerate(inputs):
        shape = list(t.shape)
        if any(d is None for d in shape[1:]):
            raise ModelImportError(
                f"from_keras: input {i} of model {model.name!r} has unknown dimensions {tuple(shape)}; "
                "build the model with a fixed input_shape"
            )
        specs.append(tf.TensorSpec([batch, *shape[1:]], tf.as_dtype(t.dtype), name=f"input_{i}"))

    def call(*xs: Any) -> Any:
        return model(xs[0] if len(xs) == 1 else list(xs), training=False)

    try:
        config = model.to_json()
    except Exception:  # noqa: BLE001 - subclassed models may have no config; it is optional
        config = None
    fn = tf.function(call, autograph=False)
    return _from_concrete(fn, specs, name or model.name, config, {"keras_model": model.name, "batch": batch})


def from_tf_function(fn: Callable[..., Any], input_signature: Sequence[Any], name: str | None = None) -> OpGraph:
    """Import a Python function or ``tf.function`` for a signature of ``tf.TensorSpec`` with static shapes."""
    tf = _tf()
    specs = list(input_signature)
    for i, s in enumerate(specs):
        if not isinstance(s, tf.TensorSpec):
            raise ModelImportError(f"from_tf_function: input_signature[{i}] is {type(s).__name__}, "
                                   "expected tf.TensorSpec")
        if not s.shape.is_fully_defined():
            raise ModelImportError(
                f"from_tf_function: input_signature[{i}] has shape {s.shape}; opsched needs fully defined "
                "shapes (fix the batch size) to count FLOPs and bytes"
            )
    if not isinstance(fn, tf.types.experimental.PolymorphicFunction):
        fn = tf.function(fn, autograph=False)
    fname = name or getattr(fn, "__name__", None) or getattr(getattr(fn, "python_function", None), "__name__", "fn")
    return _from_concrete(fn, specs, fname, None, {})


# ----------------------------------------------------------------- internals
def _from_concrete(fn: Any, specs: list[Any], name: str, keras_config: str | None,
                   meta: dict[str, Any]) -> OpGraph:
    _tf()
    try:
        concrete = fn.get_concrete_function(*specs)
    except Exception as exc:  # noqa: BLE001 - tracing errors come in every type; say where
        raise ModelImportError(f"cannot trace {name!r} for signature {specs}: {type(exc).__name__}: {exc}") from None
    try:
        graph_def, in_names, out_names = _freeze(concrete)
    except Exception as exc:  # noqa: BLE001
        raise ModelImportError(f"cannot freeze {name!r} (variables to constants): {exc}") from None
    if not out_names:
        raise ModelImportError(f"{name!r} returns no tensors")
    graph_def = _grappler_simplify(graph_def, out_names)
    return graph_from_graph_def(graph_def, in_names, out_names, name, keras_config=keras_config, meta=meta)


def _freeze(concrete: Any) -> tuple[Any, list[str], list[str]]:
    """(frozen GraphDef, feed tensor names, fetch tensor names) of a concrete function.

    Uses the converter behind ``convert_variables_to_constants_v2`` without
    rebuilding a ConcreteFunction from the result (that step costs several
    seconds on a ResNet and the importer only needs the GraphDef); falls back
    to the public function if the private helper moves.
    """
    tf = _tf()
    from tensorflow.python.framework import convert_to_constants as c2c

    try:
        data = c2c._FunctionConverterDataInEager(func=concrete, lower_control_flow=True,
                                                 aggressive_inlining=False)
        graph_def, _ = c2c._replace_variables_by_constants(converter_data=data)
        placeholders = {n.name for n in graph_def.node if n.op == "Placeholder"}
        feeds = [t.name for t in concrete.inputs if t.dtype != tf.resource and t.op.name in placeholders]
        fetches = [t.name for t in concrete.outputs]
        return graph_def, feeds, fetches
    except AttributeError:  # pragma: no cover - TensorFlow moved its private helpers
        frozen = c2c.convert_variables_to_constants_v2(concrete)
        return (frozen.graph.as_graph_def(), [t.name for t in frozen.inputs if t.dtype != tf.resource],
                [t.name for t in frozen.outputs])


def _grappler_simplify(graph_def: Any, fetches: Sequence[str]) -> Any:
    """Constant folding and Identity/NoOp removal by Grappler itself (nothing else)."""
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers[:] = ["constfold", "common_subgraph_elimination", "dependency"]
    rewrite.min_graph_nodes = -1  # optimise small graphs too
    meta_graph = meta_graph_pb2.MetaGraphDef()
    meta_graph.graph_def.CopyFrom(graph_def)
    fetch = meta_graph_pb2.CollectionDef()
    for t in fetches:
        fetch.node_list.value.append(t)
    meta_graph.collection_def["train_op"].CopyFrom(fetch)
    try:
        return tf_optimizer.OptimizeGraph(config, meta_graph)
    except Exception as exc:  # noqa: BLE001
        raise ModelImportError(f"Grappler could not simplify the graph: {exc}") from None


def _tensor_bytes(shape: Sequence[int], dtype: Any) -> float:
    size = getattr(dtype, "size", None) or 4
    return float(np.prod(shape, dtype=np.float64)) * size if len(shape) else float(size)


def _static_shape(t: Any, where: str) -> tuple[int, ...]:
    if t.shape.rank is None:
        raise ModelImportError(f"tensor {t.name!r} ({where}) has unknown rank; fix the input shapes")
    return tuple(int(d) if d is not None else 1 for d in t.shape.as_list())


def _split(inp: str) -> tuple[str, int]:
    name, _, idx = inp.partition(":")
    return name, int(idx) if idx else 0


def graph_from_graph_def(graph_def: Any, inputs: Sequence[str], outputs: Sequence[str], name: str = "tf",
                         keras_config: str | None = None, meta: dict[str, Any] | None = None) -> OpGraph:
    """Build the OpGraph of a frozen ``GraphDef`` whose feeds are ``inputs`` and fetches ``outputs``.

    Views are looked through; nodes that depend on no feed are constants (their
    bytes become parameter bytes of the ops that read them).
    """
    tf = _tf()
    g = tf.Graph()
    with g.as_default():
        try:
            tf.graph_util.import_graph_def(graph_def, name="")
        except Exception as exc:  # noqa: BLE001
            raise ModelImportError(f"{name!r}: the simplified GraphDef does not import: {exc}") from None
    feed_nodes = {_split(t)[0] for t in inputs}
    for n in feed_nodes:
        try:
            g.get_operation_by_name(n)
        except KeyError:
            raise ModelImportError(f"{name!r}: input {n!r} is not in the graph") from None

    # Which nodes depend on a feed (compute) versus only on constants.
    ops_in_order = g.get_operations()
    dynamic: dict[str, bool] = {}
    for o in ops_in_order:  # import order is topological
        dynamic[o.name] = o.name in feed_nodes or any(dynamic.get(t.op.name, False) for t in o.inputs)
    def source_of(t: Any) -> str | None:
        while t.op.type in VIEW_OPS and t.op.inputs:
            t = t.op.inputs[t.value_index] if t.op.type == "IdentityN" else t.op.inputs[0]
        o = t.op
        if o.name in feed_nodes or not dynamic.get(o.name, False) or o.type in _SKIP_OPS:
            return None
        return o.name  # the producing op of a tensor (None: a feed or a constant), looking through views

    removed: dict[str, int] = {}
    out_ops: list[Op] = []
    edges: list[Edge] = []
    kept: set[str] = set()
    for o in ops_in_order:
        if o.name in feed_nodes:
            continue
        if not dynamic[o.name] or o.type in VIEW_OPS or o.type in _SKIP_OPS:
            removed[o.type] = removed.get(o.type, 0) + 1
            continue
        read = 0.0
        params = 0.0
        for t in o.inputs:
            nbytes = _tensor_bytes(_static_shape(t, f"input of {o.name}"), t.dtype)
            read += nbytes
            src = source_of(t)
            if src is not None:
                edges.append(Edge(src, o.name, nbytes))
            elif _is_constant(t, feed_nodes, dynamic):
                params += nbytes
        outs = [t for t in o.outputs if t.consumers() or t.value_index == 0]
        written = sum(_tensor_bytes(_static_shape(t, f"output of {o.name}"), t.dtype) for t in outs)
        shape = _static_shape(o.outputs[0], f"output of {o.name}") if o.outputs else ()
        dtype = o.outputs[0].dtype.name if o.outputs else "float32"
        out_ops.append(Op(
            id=o.name, name=o.name, kind=KIND_OF.get(o.type, "other"), flops=float(_flops(o)),
            bytes_read=read, bytes_written=float(written), param_bytes=params, shape=shape, dtype=dtype,
        ))
        kept.add(o.name)
    if not out_ops:
        raise ModelImportError(f"{name!r}: no compute op depends on the inputs {list(inputs)}")
    output_ops = []
    for t in outputs:
        src = source_of(g.get_tensor_by_name(t))
        if src is not None:
            output_ops.append(src)
    op_types = {}
    for o in ops_in_order:
        if o.name in kept:
            op_types[o.type] = op_types.get(o.type, 0) + 1
    full_meta = {
        "framework": "tensorflow",
        "tf_version": tf.__version__,
        "inputs": [{"name": t, "shape": list(_static_shape(g.get_tensor_by_name(t), "feed")),
                    "dtype": g.get_tensor_by_name(t).dtype.name} for t in inputs],
        "outputs": list(outputs),
        "output_ops": output_ops,
        "tf_op_types": dict(sorted(op_types.items())),
        "removed_nodes": dict(sorted(removed.items())),
        **(meta or {}),
    }
    graph = OpGraph(tuple(out_ops), tuple(edges), name=name, meta=full_meta)
    source = TFSource(
        graph_def=graph_def.SerializeToString(),
        inputs=tuple(TensorInfo(t, tuple(full_meta["inputs"][i]["shape"]), full_meta["inputs"][i]["dtype"])
                     for i, t in enumerate(inputs)),
        outputs=tuple(outputs),
        op_nodes=tuple(op.id for op in out_ops),
        keras_config=keras_config,
    )
    return graph.with_source(source)


def _is_constant(t: Any, feed_nodes: set[str], dynamic: dict[str, bool]) -> bool:
    o = t.op
    return o.name not in feed_nodes and not dynamic.get(o.name, False)


# ---------------------------------------------------------------------- FLOPs
def _elems(t: Any) -> float:
    return float(np.prod(_static_shape(t, "flops"), dtype=np.float64))


def _flops(o: Any) -> float:
    """FLOPs of one TF op from its static shapes (a multiply-add counts 2)."""
    typ = o.type
    if typ in ("Conv2D", "Conv3D", "_FusedConv2D", "DepthwiseConv2dNative", "_FusedDepthwiseConv2dNative"):
        out = _static_shape(o.outputs[0], o.name)
        filt = _static_shape(o.inputs[1], o.name)  # [Kh, Kw, (Kd,) Ci, Co] or depthwise [Kh, Kw, Ci, M]
        n_out = float(np.prod(out, dtype=np.float64))
        if "Depthwise" in typ:
            taps = float(np.prod(filt[:-2], dtype=np.float64))  # one input channel per output channel
        else:
            taps = float(np.prod(filt[:-1], dtype=np.float64))  # Kh*Kw*Ci (groups: Ci of the filter is Ci/groups)
        return 2.0 * n_out * taps
    if typ in ("Conv2DBackpropInput", "Conv3DBackpropInputV2"):  # transposed convolution
        filt = _static_shape(o.inputs[1], o.name)  # [Kh, Kw, Co, Ci]
        grad = _static_shape(o.inputs[2], o.name)  # the "input" of the transposed conv
        return 2.0 * float(np.prod(grad, dtype=np.float64)) * float(np.prod(filt[:-2], dtype=np.float64)) * filt[-2]
    if typ in ("MatMul", "_FusedMatMul"):
        a = _static_shape(o.inputs[0], o.name)
        k = a[0] if o.get_attr("transpose_a") else a[-1]
        return 2.0 * _elems(o.outputs[0]) * k
    if typ.startswith("BatchMatMul") or typ == "_FusedBatchMatMulV2":
        a = _static_shape(o.inputs[0], o.name)
        adj = "adj_x" in o.node_def.attr and o.get_attr("adj_x")
        k = a[-2] if adj else a[-1]
        return 2.0 * _elems(o.outputs[0]) * k
    if typ == "Einsum":
        return _einsum_flops(o)
    if typ in ("MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D"):
        ksize = o.get_attr("ksize")
        return _elems(o.outputs[0]) * float(np.prod(ksize, dtype=np.float64))
    if typ in _KINDS["reduce"]:
        return _elems(o.inputs[0])
    if typ in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "_FusedBatchNormEx"):
        return 2.0 * _elems(o.outputs[0])  # inference: x * scale + shift
    if typ in ("Softmax", "LogSoftmax"):
        return 5.0 * _elems(o.outputs[0])  # max, subtract, exp, sum, divide
    if typ == "AddN":
        return _elems(o.outputs[0]) * max(1, len(o.inputs) - 1)
    if typ in _ELEMENTWISE:
        return _elems(o.outputs[0])
    return 0.0


def _einsum_flops(o: Any) -> float:
    eq = o.get_attr("equation")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    lhs, _, _ = eq.replace(" ", "").partition("->")
    if "." in lhs:
        return 2.0 * _elems(o.outputs[0])
    sizes: dict[str, int] = {}
    for term, t in zip(lhs.split(","), o.inputs):
        for letter, d in zip(term, _static_shape(t, o.name)):
            sizes[letter] = d
    return 2.0 * float(np.prod(list(sizes.values()), dtype=np.float64)) if sizes else 0.0

