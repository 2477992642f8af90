"""ONNX models in, the graph ONNX Runtime actually runs out.

:func:`from_onnx` hands the model to ONNX Runtime at the optimisation level it
will run with (``all`` by default, ONNX Runtime's own default), dumps the graph
ONNX Runtime made of it (``SessionOptions.optimized_model_filepath``: fusions,
blocked ``NCHWc`` layouts, constant folding included) and imports *that*: one
op per node of the optimised graph, one edge per tensor a node reads from
another, with the tensor's bytes.  So opsched plans the kernels that run, not
the nodes that were exported.

Shapes: ``onnx.shape_inference`` knows the standard operators but not ONNX
Runtime's contrib and layout operators (``com.microsoft``,
``com.microsoft.nchwc``), which an optimised graph is full of; the importer
takes what shape inference gives and records the rest from one run of the
optimised graph on the example inputs with every value exposed as an output.
FLOPs and bytes per node follow from the shapes (:func:`node_cost`); op kinds
map onto :data:`opsched.graph.OP_KINDS` (:func:`op_kind`).

The graph carries an :class:`OnnxSource`: the optimised model (node names made
unique: they are the op ids), every value's shape and dtype, the example
inputs, and the original model for reference sessions.  The ``ort`` backend
(``opsched.backends.ort_backend``) cuts sub-models out of it with
:meth:`OnnxSource.submodel`.

PyTorch modules become ONNX with :func:`export_torch` (``torch.onnx.export``,
``dynamo=False``: the TorchScript exporter needs no onnxscript); the specs'
exports are cached in the per-user cache's ``onnx/`` (:mod:`opsched.cache`) (:func:`cached_export`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np

from opsched.cache import onnx_dir
from opsched.errors import ModelImportError
from opsched.graph import Edge, Op, OpGraph

#: ``opt_level`` names -> ``onnxruntime.GraphOptimizationLevel`` member names.
OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}
DEFAULT_OPT_LEVEL = "all"

_KINDS: dict[str, str] = {}
for _kind, _names in {
    "conv": "Conv FusedConv ConvTranspose ConvInteger QLinearConv NhwcFusedConv",
    "matmul": "Gemm MatMul FusedMatMul FusedGemm MatMulInteger QLinearMatMul MatMulNBits DynamicQuantizeMatMul",
    "attention": "Attention MultiHeadAttention GroupQueryAttention",
    "rnn": "LSTM GRU RNN DynamicQuantizeLSTM",
    "pool": "MaxPool AveragePool GlobalAveragePool GlobalMaxPool LpPool MaxRoiPool Upsample Resize",
    "norm": "BatchNormalization LayerNormalization SkipLayerNormalization SimplifiedLayerNormalization "
            "SkipSimplifiedLayerNormalization InstanceNormalization GroupNorm LpNormalization "
            "EmbedLayerNormalization",
    "reduce": "Softmax LogSoftmax ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL2 ReduceL1 "
              "ReduceLogSumExp ReduceSumSquare ArgMax ArgMin TopK CumSum",
    "concat_split": "Concat Split Slice Reshape Squeeze Unsqueeze Flatten Transpose Expand Tile Pad "
                    "ReorderInput ReorderOutput Identity SplitToSequence ConcatFromSequence DepthToSpace "
                    "SpaceToDepth",
    "embedding": "Gather GatherElements GatherND",
}.items():
    _KINDS.update(dict.fromkeys(_names.split(), _kind))


def op_kind(op_type: str) -> str:
    """The opsched kind of an ONNX (or ONNX Runtime contrib) operator; element-wise
    unless it is a known compute, data-movement or reduction operator."""
    if op_type in _KINDS:
        return _KINDS[op_type]
    if op_type in ("Shape", "Size", "Constant", "ConstantOfShape", "Range", "NonZero", "If", "Loop", "Scan"):
        return "other"
    return "elementwise"


# ------------------------------------------------------------------ values
@dataclass(frozen=True)
class ValueInfo:
    """A tensor's shape and numpy dtype."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> float:
        return float(np.prod(self.shape, dtype=float)) * np.dtype(self.dtype).itemsize if self.shape else \
            float(np.dtype(self.dtype).itemsize)


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def node_cost(node: Any, ins: Sequence[ValueInfo | None], outs: Sequence[ValueInfo | None]) -> float:
    """FLOPs of one node from its input and output shapes (a multiply-add is two)."""
    out = outs[0] if outs else None
    n_out = float(np.prod(out.shape, dtype=float)) if out is not None and out.shape else 1.0
    t = node.op_type
    kind = op_kind(t)
    w = ins[1] if len(ins) > 1 else None
    if kind == "conv" and w is not None and len(w.shape) >= 2:
        return 2.0 * n_out * float(np.prod(w.shape[1:], dtype=float)) + n_out * max(0, len(ins) - 2)
    if kind == "matmul" and ins and ins[0] is not None and ins[0].shape:
        a = ins[0].shape
        k = a[-2] if t in ("Gemm", "FusedGemm") and _attr(node, "transA", 0) else a[-1]
        return 2.0 * n_out * float(k) + n_out * max(0, len(ins) - 2)
    if kind == "pool":
        if t.startswith("Global") and ins and ins[0] is not None:
            return float(np.prod(ins[0].shape, dtype=float))
        return n_out * float(np.prod(_attr(node, "kernel_shape", [1]), dtype=float))
    if kind in ("norm", "reduce", "attention", "rnn"):
        n_in = float(np.prod(ins[0].shape, dtype=float)) if ins and ins[0] is not None and ins[0].shape else n_out
        return 5.0 * max(n_in, n_out)
    if kind in ("concat_split", "embedding", "other"):
        return 0.0
    return n_out * max(1, len(ins) - 1)


# ------------------------------------------------------------------ source
@dataclass
class OnnxSource:
    """What the ``ort`` backend needs to run an imported ONNX graph.

    ``model`` is the optimised ``ModelProto`` (its node names are the op ids);
    ``values`` every tensor's :class:`ValueInfo`; ``initializers`` the names
    of the weights; ``inputs`` / ``outputs`` the graph's input and output
    names; ``original`` the model bytes before optimisation (what a reference
    ONNX Runtime session loads); ``opt_level`` the level it was optimised at."""

    model: Any
    values: dict[str, ValueInfo]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    example_inputs: tuple[np.ndarray, ...]
    original: bytes = field(repr=False, default=b"")
    opt_level: str = DEFAULT_OPT_LEVEL
    #: The op ids in the order ONNX Runtime saved the optimised graph (its own execution order
    #: in this process; the graph's ops follow a canonical order instead, see ``_canonical_order``).
    ort_order: tuple[str, ...] = ()

    @cached_property
    def nodes(self) -> dict[str, Any]:
        """Op id (node name) -> NodeProto."""
        return {n.name: n for n in self.model.graph.node}

    @cached_property
    def initializers(self) -> dict[str, Any]:
        return {t.name: t for t in self.model.graph.initializer}

    @cached_property
    def producer(self) -> dict[str, str]:
        """Value name -> the op id that writes it."""
        return {o: n.name for n in self.model.graph.node for o in n.output if o}

    @cached_property
    def _input_spec(self) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
        return tuple((n, self.values[n].shape, np.dtype(self.values[n].dtype)) for n in self.inputs)

    def input_signature(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        return tuple((self.values[n].shape, self.values[n].dtype) for n in self.inputs)

    def check_inputs(self, inputs: Sequence[Any]) -> list[np.ndarray]:
        """``inputs`` as numpy arrays, checked against the planned shapes and dtypes."""
        if len(inputs) != len(self.inputs):
            raise ModelImportError(f"the ONNX model takes {len(self.inputs)} input(s) "
                                   f"({', '.join(self.inputs)}), got {len(inputs)}")
        out = []
        for (name, shape, dtype), x in zip(self._input_spec, inputs, strict=True):
            a = x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)
            if a.shape != shape or a.dtype != dtype:
                want = self.values[name]
                raise ModelImportError(f"input {name!r} is {a.dtype}{list(a.shape)}; the graph was imported for "
                                       f"{want.dtype}{list(want.shape)}")
            out.append(a)
        return out

    def submodel(self, op_ids: Sequence[str], inputs: Sequence[str], outputs: Sequence[str],
                 name: str = "segment") -> bytes:
        """The serialised ONNX model of the nodes ``op_ids`` (in that order) reading
        ``inputs`` and writing ``outputs``, with the weights they use."""
        from onnx import helper

        nodes = [self.nodes[i] for i in op_ids]
        inits = self.initializers
        used = list(dict.fromkeys(x for n in nodes for x in n.input if x in inits))
        g = helper.make_graph(nodes, name, [self._vi(x) for x in inputs], [self._vi(x) for x in outputs],
                              initializer=[inits[x] for x in used])
        m = helper.make_model(g, opset_imports=list(self.model.opset_import), ir_version=self.model.ir_version)
        return m.SerializeToString()

    def _vi(self, name: str) -> Any:
        from onnx import helper

        v = self.values[name]
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(v.dtype)), list(v.shape))

    def shared_weight(self, name: str) -> Any:
        """The weight ``name`` as one ``OrtValue`` for every session that is given it
        (``SessionOptions.add_initializer``; kept alive here with its array)."""
        cache = self.__dict__.setdefault("_shared_weights", {})
        hit = cache.get(name)
        if hit is None:
            import onnxruntime as ort
            from onnx import numpy_helper

            arr = np.ascontiguousarray(numpy_helper.to_array(self.initializers[name]))
            hit = cache[name] = (arr, ort.OrtValue.ortvalue_from_numpy(arr))
        return hit[1]

    def random_inputs(self, seed: int = 0) -> tuple[np.ndarray, ...]:
        return random_arrays([self.values[n] for n in self.inputs], seed)


def random_arrays(infos: Sequence[ValueInfo], seed: int = 0) -> tuple[np.ndarray, ...]:
    """Deterministic example inputs: standard normal floats, small non-negative integers."""
    rng = np.random.default_rng(seed)
    out = []
    for v in infos:
        dt = np.dtype(v.dtype)
        if dt.kind == "f":
            out.append(rng.standard_normal(v.shape).astype(dt))
        elif dt.kind == "b":
            out.append(rng.random(v.shape) < 0.5)
        else:
            out.append(rng.integers(0, 2, v.shape).astype(dt))
    return tuple(out)


# ------------------------------------------------------------------ import
def session_options(threads: int = 0, opt_level: str = "disable", spinning: bool | int = True) -> Any:
    """Sequential-mode ``SessionOptions`` with ``threads`` intra-op threads (0: ONNX Runtime's default);
    ``spinning``: the intra-op pool spin-waits between parallel regions as long as ONNX
    Runtime's default (True), never (False), or up to this many microseconds (an int)."""
    import onnxruntime as ort

    if opt_level not in OPT_LEVELS:
        raise ModelImportError(f"ONNX Runtime optimisation level must be one of {', '.join(OPT_LEVELS)}, "
                               f"got {opt_level!r}")
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[opt_level])
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = int(threads)
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if spinning is False:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif spinning is not True:
        so.add_session_config_entry("session.intra_op.spin_duration_us", str(int(spinning)))
    return so


def parse_model(model: str | Path | bytes | Any) -> Any:
    """The ``onnx.ModelProto`` of a path, bytes or a proto; a file that is not a
    well-formed ONNX model with a graph (random bytes, text, a truncated file, an
    empty one) is a :class:`ModelImportError` naming it, never a protobuf traceback."""
    import onnx

    if hasattr(model, "graph") and hasattr(model, "SerializeToString"):
        return model
    where = repr(str(model)) if isinstance(model, (str, Path)) else "the given bytes"
    data = _load_bytes(model)
    if not data:
        raise ModelImportError(f"ONNX model {where} is empty (0 bytes)")
    try:
        proto = onnx.load_from_string(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ModelImportError(f"{where} is not an ONNX model: it does not parse as an onnx.ModelProto "
                               f"({type(exc).__name__}: {exc}); the file is truncated, corrupt or of another "
                               "format") from None
    if not proto.HasField("graph") or not proto.graph.node:
        raise ModelImportError(f"{where} is not an ONNX model with a graph (it parses, but holds no nodes): "
                               "the file is truncated, corrupt or of another format")
    return proto


def _load_bytes(model: str | Path | bytes | Any) -> bytes:
    if isinstance(model, bytes):
        return model
    if isinstance(model, (str, Path)):
        p = Path(model)
        if not p.is_file():
            raise ModelImportError(f"no such ONNX file {str(p)!r}")
        return p.read_bytes()
    if hasattr(model, "SerializeToString"):
        return model.SerializeToString()
    raise ModelImportError(f"expected an ONNX file path, bytes or a ModelProto, got {type(model).__name__}")


def _optimise(data: bytes, opt_level: str) -> Any:
    """The graph ONNX Runtime makes of ``data`` at ``opt_level``, as a ModelProto."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="opsched-ort-") as tmp:
        so = session_options(1, opt_level)
        so.optimized_model_filepath = os.path.join(tmp, "optimised.onnx")
        try:
            ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own exception types
            raise ModelImportError(f"ONNX Runtime cannot load the model: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:300]}") from exc
        return onnx.load(so.optimized_model_filepath)


def _canonical_names(model: Any) -> list[str]:
    """Give every node a unique name that is the same on every import (the op ids), put
    the nodes in a canonical order, and return their names in ONNX Runtime's order.

    ONNX Runtime numbers the nodes and values its optimisers create from a
    counter (``ReorderOutput_token_17``) whose order varies from run to run;
    such a node is named after what it computes instead: its operator and a
    hash of its attributes and inputs (the producers' names, a weight's
    content), so profiles and plans keyed by the graph's fingerprint stay valid."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    weights = {t.name: t for t in model.graph.initializer}
    names: dict[int, str] = {}
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.name] = counts.get(n.name, 0) + 1
    seen: set[str] = set()
    for n in model.graph.node:  # topological: producers are named first
        name = n.name
        if not name or "token" in name or name == n.op_type or counts[name] > 1:
            h = hashlib.sha1(f"{n.domain}.{n.op_type}".encode())
            h.update(b"".join(a.SerializeToString(deterministic=True)
                              for a in sorted(n.attribute, key=lambda a: a.name)))
            for x in n.input:
                if x in producer:
                    p = producer[x]
                    h.update(f"<{names[id(p)]}:{list(p.output).index(x)}".encode())
                elif x in weights:
                    t = weights[x]
                    h.update(f"<w{list(t.dims)}".encode())
                    h.update(hashlib.sha1(t.SerializeToString(deterministic=True)).digest()
                             if "token" in x else x.encode())
                else:
                    h.update(f"<{x}".encode())
            name = f"{n.op_type}:{h.hexdigest()[:10]}"
        base, k = name, 1
        while name in seen:
            k += 1
            name = f"{base}#{k}"
        seen.add(name)
        names[id(n)] = name
    for n in model.graph.node:
        n.name = names[id(n)]
    ort_order = [n.name for n in model.graph.node]
    _canonical_order(model)
    return ort_order


def _canonical_order(model: Any) -> None:
    """Reorder the nodes into one topological order that does not depend on the
    order ONNX Runtime saved them in (which varies between runs): depth first
    (a node's consumers follow it, which keeps producer and consumer close),
    nodes made ready together taken by name."""
    nodes = list(model.graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    consumers: list[list[int]] = [[] for _ in nodes]
    indeg = [0] * len(nodes)
    for k, n in enumerate(nodes):
        for p in dict.fromkeys(producer[x] for x in n.input if x in producer):
            consumers[p].append(k)
            indeg[k] += 1
    stack = sorted((k for k in range(len(nodes)) if not indeg[k]), key=lambda k: nodes[k].name, reverse=True)
    order = []
    while stack:
        k = stack.pop()
        order.append(k)
        ready = []
        for c in consumers[k]:
            indeg[c] -= 1
            if not indeg[c]:
                ready.append(c)
        stack.extend(sorted(ready, key=lambda c: nodes[c].name, reverse=True))
    if len(order) != len(nodes):
        raise ModelImportError("the optimised ONNX graph has a cycle")
    copies = [type(nodes[k])() for k in order]
    for c, k in zip(copies, order, strict=True):
        c.CopyFrom(nodes[k])
    del model.graph.node[:]
    model.graph.node.extend(copies)


def _value_infos(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, ValueInfo]:
    """Every value's shape and dtype: graph inputs and weights, then shape
    inference, then one run with every node output exposed for the rest."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    values = {k: ValueInfo(tuple(int(d) for d in a.shape), str(a.dtype)) for k, a in feeds.items()}
    for t in model.graph.initializer:
        values[t.name] = ValueInfo(tuple(int(d) for d in t.dims),
                                   str(helper.tensor_dtype_to_np_dtype(t.data_type)))
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
            tt = vi.type.tensor_type
            dims = [d.dim_value for d in tt.shape.dim if d.HasField("dim_value")]
            # every dimension known
            if tt.elem_type and tt.HasField("shape") and len(dims) == len(tt.shape.dim):
                values.setdefault(vi.name, ValueInfo(tuple(int(d) for d in dims),
                                                     str(helper.tensor_dtype_to_np_dtype(tt.elem_type))))
    except Exception:  # noqa: BLE001 - contrib ops: the run below fills in every value
        pass
    missing = [o for n in model.graph.node for o in n.output if o and o not in values]
    if missing:
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        have = {o.name for o in probe.graph.output}
        probe.graph.output.extend(onnx.ValueInfoProto(name=o) for o in missing if o not in have)
        sess = ort.InferenceSession(probe.SerializeToString(), session_options(1, "disable"),
                                    providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        for name, val in zip(names, sess.run(names, feeds), strict=True):
            a = np.asarray(val)
            values.setdefault(name, ValueInfo(tuple(int(d) for d in a.shape), str(a.dtype)))
    return values


def _graph_inputs(proto: Any) -> list[Any]:
    inits = {t.name for t in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in inits]


def example_inputs(model: str | Path | bytes | Any, batch: int = 1, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Random inputs for an ONNX model's declared inputs: ``batch`` for each input's
    symbolic first dimension, 1 for other symbolic dimensions."""
    import onnx

    proto = parse_model(model)
    infos = []
    for gi in _graph_inputs(proto):
        tt = gi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (batch if k == 0 else 1)
                for k, d in enumerate(tt.shape.dim)]
        infos.append(ValueInfo(tuple(int(d) for d in dims), str(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))))
    return random_arrays(infos, seed)


def from_onnx(model: str | Path | bytes | Any, inputs: Sequence[Any] | None = None, *, name: str | None = None,
              batch: int = 1, opt_level: str = DEFAULT_OPT_LEVEL, seed: int = 0) -> OpGraph:
    """The OpGraph of the graph ONNX Runtime runs for ``model`` (see the module docstring).

    ``inputs``: example inputs (numpy arrays or tensors, one per graph input),
    which fix every shape; by default random ones, with ``batch`` for each
    input's symbolic first dimension (other symbolic dimensions: 1)."""

    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise ModelImportError("importing ONNX models needs onnxruntime (pip install onnx onnxruntime)") from exc
    proto = parse_model(model)
    data = proto.SerializeToString() if not isinstance(model, (bytes, str, Path)) else _load_bytes(model)
    graph_inputs = _graph_inputs(proto)
    if name is None:
        name = Path(model).stem if isinstance(model, (str, Path)) else str(proto.graph.name or "onnx")
    if inputs is None:
        arrays = example_inputs(proto, batch, seed)
    else:
        arrays = tuple(x.detach().numpy() if hasattr(x, "detach") else np.asarray(x) for x in inputs)
        if len(arrays) != len(graph_inputs):
            raise ModelImportError(f"ONNX model {name!r} takes {len(graph_inputs)} input(s), got {len(arrays)}")
    feeds = {gi.name: a for gi, a in zip(graph_inputs, arrays, strict=True)}
    optimised = _optimise(data, opt_level)
    ort_order = _canonical_names(optimised)
    values = _value_infos(optimised, feeds)
    src = OnnxSource(optimised, values, tuple(feeds), tuple(o.name for o in optimised.graph.output), arrays,
                     data, opt_level, tuple(ort_order))
    return _build_graph(src, name)


def _build_graph(src: OnnxSource, name: str) -> OpGraph:
    inits = src.initializers
    ops, edges = [], []
    producer = src.producer
    for n in src.model.graph.node:
        ins = [src.values.get(x) if x else None for x in n.input]
        outs = [src.values.get(x) for x in n.output if x]
        read = sum(v.nbytes for v in ins if v is not None)
        param = sum(src.values[x].nbytes for x in n.input if x in inits)
        written = sum(v.nbytes for v in outs if v is not None)
        out = outs[0] if outs and outs[0] is not None else None
        ops.append(Op(n.name, n.op_type if not n.domain or n.domain == "ai.onnx" else f"{n.domain}.{n.op_type}",
                      op_kind(n.op_type), node_cost(n, ins, outs), read, written, param,
                      out.shape if out is not None else (), out.dtype if out is not None else "float32"))
        for x in dict.fromkeys(x for x in n.input if x in producer):
            edges.append(Edge(producer[x], n.name, src.values[x].nbytes if x in src.values else 0.0))
    meta = {"framework": "onnx", "runtime": "onnxruntime", "opt_level": src.opt_level}
    return OpGraph(tuple(ops), tuple(edges), name=name, meta=meta).with_source(src)


# ------------------------------------------------------------------ export
def export_torch(module: Any, inputs: Sequence[Any], path: str | Path) -> Path:
    """Export a PyTorch module with ``torch.onnx.export(..., dynamo=False)`` to
    ``path`` (atomically); :class:`ModelImportError` naming the reason on failure."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, tuple(inputs), str(tmp), dynamo=False)
        os.replace(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        raise ModelImportError(f"torch.onnx.export failed: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from exc
    return path


def export_key(parts: Sequence[str], files: Sequence[Path] = ()) -> str:
    """A cache key from the export's description and the sources that built the model."""
    import torch

    h = hashlib.sha256("|".join([torch.__version__, *parts]).encode())
    for f in files:
        if Path(f).is_file():
            h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def cached_export(module: Any, inputs: Sequence[Any], key: str | None, name: str,
                  cache_dir: str | Path | None | Literal[False] = None) -> bytes:
    """The ONNX bytes of ``module`` exported on ``inputs``; kept under ``cache_dir``
    as ``<name>_<key>.onnx`` when a ``key`` is given (else exported afresh)."""
    if key is None or cache_dir is False:
        with tempfile.TemporaryDirectory(prefix="opsched-export-") as tmp:
            return export_torch(module, inputs, Path(tmp) / "model.onnx").read_bytes()
    path = onnx_dir(cache_dir) / f"{name}_{key}.onnx"
    if not path.is_file():
        export_torch(module, inputs, path)
    return path.read_bytes()


def from_torch_via_onnx(module: Any, inputs: Sequence[Any], *, name: str = "model", key: str | None = None,
                        cache_dir: str | Path | None | Literal[False] = None,
                        opt_level: str = DEFAULT_OPT_LEVEL) -> OpGraph:
    """A PyTorch module exported to ONNX (cached by ``key``) and imported with :func:`from_onnx`."""
    data = cached_export(module, inputs, key, name, cache_dir)
    return from_onnx(data, inputs, name=name, opt_level=opt_level)


__all__ = ["DEFAULT_OPT_LEVEL", "OPT_LEVELS", "OnnxSource", "ValueInfo", "cached_export",
           "example_inputs", "export_key", "export_torch", "from_onnx", "from_torch_via_onnx", "node_cost", "op_kind",
           "random_arrays", "session_options"]
