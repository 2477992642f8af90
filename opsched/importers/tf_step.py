"""Capture a Keras training step - forward, loss, backward, optimizer update - as one OpGraph.

    cap = capture_keras_step(model, loss, optimizer, example_x, example_y)
    cap.graph            # the OpGraph: ops are TF nodes, graph.meta["phases"] op id -> phase
    cap.graph.source     # a TFStepSource: the step's GraphDef with its variables kept as resources
    cap.function         # the tf.function of the same step (Keras's own execution of it)

**The step** is what ``model.fit`` does per batch, written out:

    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = loss_fn(y, y_pred) (+ the model's regularization losses, as compute_loss adds them)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

traced once by ``tf.function`` (``autograph=False``) for the example's shapes.
The user's Keras optimizer (SGD with or without momentum, Adam, AdamW, any
Keras 3 optimizer that updates with variable assignments) is built on the
model's trainable variables before tracing, so its slots exist and the graph's
signature is the same at every step.

**Variables stay resources.**  Unlike :func:`opsched.importers.tf_graph.from_keras`
(which freezes weights into constants), the step's GraphDef keeps every
captured variable - weights, BatchNorm statistics, Dropout's seed state,
optimizer slots, ``iterations`` and ``learning_rate`` - as a ``resource``
placeholder (:class:`StepVariable`); the runtime binds each one to a variable
of its own (``VarHandleOp``) and the step's ``AssignVariableOp`` /
``AssignAddVariableOp`` nodes update them in place, exactly as the
``tf.function`` does in Keras.  TensorFlow's automatic control dependencies
(reads before writes of one variable, every write before the returned loss)
are part of the GraphDef and of the OpGraph (as zero-byte edges), so no plan
can reorder a read past a write.

**Ops.**  Every node that computes is an op, named by its TF node name.
Bookkeeping is looked through: placeholders, constants and nodes that depend
only on constants (Grappler folds them), variable reads, views (``Identity``,
``Reshape``, ...), ``NoOp`` and shape queries of static shapes.  An op's
predecessors are the ops it reaches upstream through such nodes, by data or
control inputs.  Variable writes (``Assign*VariableOp``) are ops: they are the
update's last nodes.  So is an ``IdentityN`` of several tensors: one node that
waits for all of them (Keras's all-reduce of the gradients is one, under the
default distribution strategy: the update starts when the last gradient is
done, in Keras's graph and so in every plan of it).

**Grouping.**  A step of more than :data:`MAX_STEP_OPS` ops (NASNetMobile's
has 12,700) is grouped phase by phase (:func:`coarsen_step`); an op then
stands for several nodes, listed in the source.

**Phases** are decided by *who created the node*: the capture counts the
graph's operations before the forward, after the loss, after
``tape.gradient`` and after ``apply_gradients`` (a graph lists its operations
in creation order), so every op is ``forward`` (model and loss, BatchNorm's
moving-statistic updates included), ``backward`` (everything
``tape.gradient`` made: the ``gradient_tape/`` name scope and the gradient
sums (``AddN``) it creates at the top level) or ``update`` (everything
``apply_gradients`` made: the optimizer's name scope, the ``iterations``
increment and AdamW's weight decay, which is not under it).  Nodes can only
read nodes created before them, so no edge goes from a later phase to an
earlier one.

Refused with :class:`~opsched.errors.ModelImportError` (naming what and
where): a model that is not built, an optimizer that is not a Keras 3
optimizer, inputs whose shapes are not fully known, a step that does not
trace, a loss that is not a scalar, a trainable variable that gets no
gradient, and graphs with nested functions or control flow (``While``,
``If``: their cost is not visible per op).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opsched.errors import ModelImportError
from opsched.graph import Edge, Op, OpGraph
from opsched.importers.tf_graph import KIND_OF, VIEW_OPS, TensorInfo, TFSource, _flops, _tensor_bytes

#: Steps with more ops are grouped to this many (the shipped policy plans at most 4096 ops).
MAX_STEP_OPS = 4096
#: Roles of a step variable.
TRAINABLE, STATE, OPTIMIZER = "trainable", "state", "optimizer"

#: Shape queries of static shapes: Grappler folds them, so they cost nothing and wait for nothing.
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs", "ConcatOffset"})
#: Nodes looked through besides :data:`~opsched.importers.tf_graph.VIEW_OPS`.
_LOOK_THROUGH = VIEW_OPS | {"ReadVariableOp", "NoOp", "Placeholder", "Const", "VarHandleOp"}
#: Variable writes: ops of the update (or of the forward, for BatchNorm's statistics).
WRITE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
#: Control flow and nested functions: refused (their ops would be invisible to the plan).
_REFUSED = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall",
                      "StatefulPartitionedCall", "Case", "StatelessCase"})

#: Kinds of the gradient ops tf_graph does not know (it imports inference graphs).
_STEP_KINDS: dict[str, str] = {
    "Conv2DBackpropFilter": "conv", "Conv2DBackpropInput": "conv",
    "DepthwiseConv2dNativeBackpropInput": "conv", "DepthwiseConv2dNativeBackpropFilter": "conv",
    "Conv3DBackpropFilterV2": "conv", "Conv3DBackpropInputV2": "conv",
    "MaxPoolGrad": "pool", "AvgPoolGrad": "pool", "MaxPoolGradV2": "pool",
    "BiasAddGrad": "reduce", "FusedBatchNormGradV3": "norm", "FusedBatchNormGrad": "norm",
    "SparseSoftmaxCrossEntropyWithLogits": "norm", "SoftmaxCrossEntropyWithLogits": "norm",
    "Tile": "concat_split", "Pad": "concat_split", "PadV2": "concat_split", "MirrorPad": "concat_split",
    "Transpose": "concat_split", "ConcatV2": "concat_split",
    "AssignAddVariableOp": "elementwise", "AssignSubVariableOp": "elementwise", "AssignVariableOp": "other",
    "StatelessRandomUniformV2": "elementwise", "StatelessRandomNormalV2": "elementwise",
    "StatelessRandomUniform": "elementwise", "StatelessRandomGetKeyCounter": "other",
}
_GRAD_ELEMENTWISE = frozenset({"ReluGrad", "Relu6Grad", "RsqrtGrad", "SqrtGrad", "TanhGrad", "SigmoidGrad",
                               "EluGrad", "SeluGrad", "SoftplusGrad", "LeakyReluGrad", "ReciprocalGrad",
                               "ZerosLike", "OnesLike", "Fill"})


@dataclass(frozen=True)
class StepVariable:
    """One variable of a step: the resource placeholder the GraphDef reads it through,
    what it is, and whether the step writes it."""

    node: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str
    written: bool

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, eq=False)
class TFStepSource(TFSource):
    """A :class:`~opsched.importers.tf_graph.TFSource` whose GraphDef is a training step.

    ``variables`` lists the step's resource placeholders (the runtime binds each
    to a variable of its own); ``initial`` holds their values at capture time as
    ``.npy`` bytes, one per variable (what a runtime's scratch copy of the state
    starts from: timing a step never trains the user's model).  ``outputs`` is
    the loss; fetching it runs every update (automatic control dependencies)."""

    variables: tuple[StepVariable, ...] = ()
    initial: tuple[bytes, ...] = field(default=(), repr=False)
    #: ops that stand for several TF nodes (:func:`coarsen_step`): (op id, members, entries, exits)
    groups: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = field(default=(),
                                                                                             repr=False)

    @property
    def state_bytes(self) -> int:
        return sum(v.nbytes for v in self.variables)


@dataclass
class KerasStepCapture:
    """What :func:`capture_keras_step` returns: the graph, the same step as a
    ``tf.function`` (``function(*x_leaves, y)`` returns the loss), the live
    variables aligned with ``graph.source.variables``, and the example's leaf
    signature (shape, dtype) per ``x`` leaf and for ``y``."""

    graph: OpGraph
    function: Any
    variables: list[Any]
    x_sig: tuple[tuple[tuple[int, ...], str], ...]
    y_sig: tuple[tuple[int, ...], str]

    @property
    def source(self) -> TFStepSource:
        return self.graph.source

    def read(self, which: Sequence[int] | None = None) -> list[np.ndarray]:
        """The live variables' values (all, or those at ``which``)."""
        idx = range(len(self.variables)) if which is None else which
        return [self.variables[i].numpy() for i in idx]

    def write(self, values: Sequence[np.ndarray], which: Sequence[int] | None = None) -> None:
        """Assign ``values`` to the live variables (all, or those at ``which``)."""
        idx = list(range(len(self.variables))) if which is None else list(which)
        if len(values) != len(idx):
            raise ValueError(f"{len(values)} values for {len(idx)} variables")
        for i, v in zip(idx, values):
            self.variables[i].assign(v)


def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelImportError(f"capturing a Keras training step needs tensorflow (pip install -e '.[tf]'): "
                               f"{exc}") from None
    return tf


def as_leaves(x: Any, what: str = "example_x") -> tuple[np.ndarray, ...]:
    """``x`` (an array, a tensor, or a tuple/list of them) as a tuple of numpy arrays."""
    items = x if isinstance(x, (tuple, list)) else (x,)
    out = []
    for i, a in enumerate(items):
        try:
            out.append(np.asarray(a))
        except Exception as exc:  # noqa: BLE001 - anything that is not array-like
            raise ModelImportError(f"{what}[{i}] is not an array ({type(a).__name__}): {exc}") from None
    if not out:
        raise ModelImportError(f"{what} is empty")
    return tuple(out)


def leaf_signature(a: np.ndarray) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in a.shape), str(a.dtype)


def resolve_loss(loss: Any) -> Callable[[Any, Any], Any]:
    """A Keras loss object for ``loss``, as ``Model.compile`` makes one: a ``keras.losses.Loss`` as it
    is; a name ``keras.losses.get`` knows or a plain function ``loss(y_true, y_pred)`` wrapped in
    ``LossFunctionWrapper`` (reduction ``sum_over_batch_size``: per-sample losses are averaged)."""
    import keras
    from keras.src.losses.losses import LossFunctionWrapper

    obj = loss
    if isinstance(loss, str):
        try:
            obj = keras.losses.get(loss)
        except (ValueError, TypeError) as exc:
            raise ModelImportError(f"unknown Keras loss {loss!r}: {exc}") from None
        if obj is None:
            raise ModelImportError(f"unknown Keras loss {loss!r}")
    if not callable(obj):
        raise ModelImportError(f"the loss must be a callable loss(y_true, y_pred) or a Keras loss name, got "
                               f"{type(loss).__name__}")
    if isinstance(obj, keras.losses.Loss):
        return obj
    return LossFunctionWrapper(obj, name=loss if isinstance(loss, str) else getattr(obj, "__name__", "loss"))


def make_step(model: Any, loss: Callable[[Any, Any], Any], optimizer: Any,
              marks: dict[str, int] | None = None) -> Callable[..., Any]:
    """The Python training step ``step(*x_leaves, y) -> loss`` (see the module docstring).

    ``marks``, when given, receives the number of operations of the graph being
    traced at each phase boundary (``start``, ``forward``, ``backward``, ``update``)."""
    tf = _tf()

    def mark(key: str) -> None:
        if marks is not None:
            marks[key] = len(tf.compat.v1.get_default_graph().get_operations())

    def step(*args: Any) -> Any:
        xs, y = args[:-1], args[-1]
        mark("start")
        with tf.GradientTape() as tape:
            y_pred = model(xs[0] if len(xs) == 1 else list(xs), training=True)
            value = loss(y, y_pred)
            extra = list(model.losses)
            if extra:  # the regularization losses, as Model.compute_loss adds them
                value = tf.add_n([value, *[tf.cast(e, value.dtype) for e in extra]])
        mark("forward")
        variables = model.trainable_variables
        grads = tape.gradient(value, variables)
        mark("backward")
        missing = [v.path for v, g in zip(variables, grads) if g is None]
        if missing:
            raise ModelImportError(f"trainable variables get no gradient from the loss: {', '.join(missing[:5])}"
                                   + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        optimizer.apply_gradients(zip(grads, variables))
        mark("update")
        return value

    return step


def capture_keras_step(model: Any, loss: Any, optimizer: Any, example_x: Any, example_y: Any,
                       name: str | None = None, max_ops: int | None = MAX_STEP_OPS) -> KerasStepCapture:
    """Trace ``model``'s training step with ``loss`` and ``optimizer`` for the example's shapes
    into an OpGraph with a :class:`TFStepSource` (see the module docstring); a step of more than
    ``max_ops`` ops is coarsened to that many (:func:`coarsen_step`; None: never)."""
    tf = _tf()
    import keras

    label = name or getattr(model, "name", type(model).__name__)
    if not isinstance(model, keras.Model):
        raise ModelImportError(f"capture_keras_step: expected a Keras model, got {type(model).__name__}")
    if not model.built:
        raise ModelImportError(f"capture_keras_step: model {label!r} is not built (call it once or give it an "
                               "Input)")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ModelImportError(f"capture_keras_step: expected a Keras optimizer (keras.optimizers.SGD, Adam, "
                               f"AdamW, ...), got {type(optimizer).__name__}")
    if not model.trainable_variables:
        raise ModelImportError(f"capture_keras_step: model {label!r} has no trainable variables")
    loss_fn = resolve_loss(loss)
    xs = as_leaves(example_x, "example_x")
    (y,) = as_leaves(example_y, "example_y")
    if not getattr(optimizer, "built", False):
        optimizer.build(model.trainable_variables)
    specs = [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype), name=f"x_{i}") for i, a in enumerate(xs)]
    specs.append(tf.TensorSpec(y.shape, tf.as_dtype(y.dtype), name="y"))
    marks: dict[str, int] = {}
    fn = tf.function(make_step(model, loss_fn, optimizer, marks), autograph=False)
    try:
        concrete = fn.get_concrete_function(*specs)
    except ModelImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - tracing errors come in every type; say where
        raise ModelImportError(f"cannot trace the training step of {label!r} for inputs "
                               f"{[tuple(s.shape) for s in specs]}: {type(exc).__name__}: {exc}") from None
    out = concrete.outputs
    if len(out) != 1 or out[0].shape.rank != 0 or not out[0].dtype.is_floating:
        raise ModelImportError(f"the loss of {label!r} must be a floating scalar, got "
                               f"{[(tuple(t.shape), t.dtype.name) for t in out]}")
    fg = concrete.graph
    variables, step_vars = _variables(fg, model, optimizer, label)
    gd = fg.as_graph_def()
    if gd.library.function:
        raise ModelImportError(f"the training step of {label!r} calls nested functions "
                               f"({', '.join(f.signature.name for f in gd.library.function[:3])}); opsched "
                               "schedules flat step graphs only")
    feeds = [t.name for t in concrete.inputs if t.dtype != tf.resource]
    graph = _opgraph(fg, feeds, out[0].name, marks, step_vars, label,
                     {"keras_model": getattr(model, "name", label), "mode": "train",
                      "optimizer": type(optimizer).__name__, "loss": getattr(loss_fn, "name",
                                                                           getattr(loss_fn, "__name__", "loss")),
                      "batch": int(xs[0].shape[0]) if xs[0].ndim else 1})
    groups: tuple = ()
    if max_ops is not None and len(graph.ops) > max_ops:
        graph, groups = coarsen_step(graph, max_ops)
    source = TFStepSource(
        groups=groups,
        graph_def=gd.SerializeToString(),
        inputs=tuple(TensorInfo(n, tuple(a.shape), str(a.dtype)) for n, a in zip(feeds, (*xs, y))),
        outputs=(out[0].name,), op_nodes=tuple(op.id for op in graph.ops), keras_config=None,
        variables=tuple(step_vars), initial=tuple(_npy(v.numpy()) for v in variables))
    return KerasStepCapture(graph.with_source(source), fn, variables, tuple(leaf_signature(a) for a in xs),
                            leaf_signature(y))


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    a = np.asarray(a)
    np.save(buf, np.ascontiguousarray(a).reshape(a.shape), allow_pickle=False)  # 0-d stays 0-d
    return buf.getvalue()


def _variables(fg: Any, model: Any, optimizer: Any, label: str) -> tuple[list[Any], list[StepVariable]]:
    """The captured variables in capture order, and their :class:`StepVariable` records."""
    tf = _tf()
    roles: dict[int, tuple[str, str]] = {}
    for role, group in ((OPTIMIZER, optimizer.variables), (STATE, model.non_trainable_variables),
                        (TRAINABLE, model.trainable_variables)):
        for kv in group:
            roles[id(getattr(kv, "value", kv))] = (role, getattr(kv, "path", kv.name))
    by_handle = {id(v.handle): v for v in fg.variables}
    writes: set[str] = set()
    for o in fg.get_operations():
        if o.type in WRITE_OPS:
            writes.add(_resource_root(o.inputs[0]))
    live, records = [], []
    for ext, internal in fg.captures:
        v = by_handle.get(id(ext))
        if v is None:
            if internal.dtype == tf.resource:
                raise ModelImportError(f"the training step of {label!r} captures a resource that is not a "
                                       f"variable ({internal.op.name})")
            raise ModelImportError(f"the training step of {label!r} captures the tensor {internal.op.name!r} by "
                                   "value (a Python-side tensor closed over); make it a Keras variable or a "
                                   "constant inside the model")
        role, path = roles.get(id(v), (STATE, v.name.split(":")[0]))
        live.append(v)
        records.append(StepVariable(internal.op.name, path, v.dtype.name, tuple(int(d) for d in v.shape), role,
                                    internal.op.name in writes))
    return live, records


def _resource_root(t: Any) -> str:
    while t.op.type in ("Identity",) and t.op.inputs:
        t = t.op.inputs[0]
    return t.op.name


def _static(t: Any, where: str) -> tuple[int, ...]:
    if t.shape.rank is None or not t.shape.is_fully_defined():
        raise ModelImportError(f"tensor {t.name!r} ({where}) has no static shape ({t.shape}); fix the input shapes")
    return tuple(int(d) for d in t.shape.as_list())


def _nbytes(t: Any) -> float:
    if t.dtype.name == "resource":
        return 0.0
    return _tensor_bytes(_static(t, "step"), t.dtype)


def _elems(t: Any) -> float:
    return float(np.prod(_static(t, "flops"), dtype=np.float64))


def step_flops(o: Any) -> float:
    """FLOPs of one op of a training step (a multiply-add counts 2): the gradient
    kernels here, everything else as :func:`opsched.importers.tf_graph._flops`."""
    typ = o.type
    if typ in ("Conv2DBackpropFilter", "Conv3DBackpropFilterV2"):
        grad = _static(o.inputs[2], o.name)         # dL/dy [N, Ho, Wo, Co]
        filt = _static(o.outputs[0], o.name)        # [Kh, Kw, Ci, Co]
        return 2.0 * float(np.prod(grad, dtype=np.float64)) * float(np.prod(filt[:-1], dtype=np.float64))
    if typ in ("DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"):
        grad = _static(o.inputs[2], o.name)         # [N, Ho, Wo, C*M]
        filt = _static(o.inputs[1], o.name) if typ.endswith("Input") else _static(o.outputs[0], o.name)
        return 2.0 * float(np.prod(grad, dtype=np.float64)) * float(np.prod(filt[:2], dtype=np.float64))
    if typ in ("MaxPoolGrad", "AvgPoolGrad", "MaxPoolGradV2"):
        ksize = o.get_attr("ksize")
        return _elems(o.inputs[-1]) * float(np.prod(ksize, dtype=np.float64))
    if typ in ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"):
        return 6.0 * _elems(o.inputs[0])
    if typ == "BiasAddGrad":
        return _elems(o.inputs[0])
    if typ in ("FusedBatchNormGradV3", "FusedBatchNormGrad"):
        return 8.0 * _elems(o.inputs[0])
    if typ in ("AssignAddVariableOp", "AssignSubVariableOp"):
        return _elems(o.inputs[1])
    if typ in _GRAD_ELEMENTWISE or typ.startswith("StatelessRandom"):
        return _elems(o.outputs[0]) if o.outputs else 0.0
    try:
        return float(_flops(o))
    except (ValueError, TypeError):  # an attr an inference graph never has
        return 0.0


def _kind(typ: str) -> str:
    if typ in _STEP_KINDS:
        return _STEP_KINDS[typ]
    if typ in _GRAD_ELEMENTWISE:
        return "elementwise"
    return KIND_OF.get(typ, "other")


def _opgraph(fg: Any, feeds: Sequence[str], fetch: str, marks: dict[str, int], step_vars: Sequence[StepVariable],
             name: str, meta: dict[str, Any]) -> OpGraph:
    """The OpGraph of a traced step graph (ops, contracted edges, phases)."""
    ops = _topological(fg.get_operations())
    refused = sorted({o.type for o in ops if o.type in _REFUSED})
    if refused:
        raise ModelImportError(f"the training step of {name!r} has control flow or nested functions "
                               f"({', '.join(refused)}); opsched schedules flat step graphs only")
    feed_nodes = {f.split(":")[0] for f in feeds}
    resources = {v.node for v in step_vars}
    position = {o.name: i for i, o in enumerate(ops)}
    # const: depends on no feed and no variable (Grappler folds it); kept: an op of the OpGraph.
    const: dict[str, bool] = {}
    kept: set[str] = set()
    for o in ops:
        ins = [t.op.name for t in o.inputs] + [c.name for c in o.control_inputs]
        if o.name in feed_nodes or o.name in resources:
            const[o.name] = False
            continue
        const[o.name] = o.type in ("Const", *SHAPE_OPS) or (
            not o.op_def.is_stateful and all(const.get(i, False) for i in ins))
        barrier = o.type == "IdentityN" and len(o.inputs) > 1  # waits for all its inputs: an op of its own
        if not const[o.name] and (barrier or (o.type not in _LOOK_THROUGH and o.type not in SHAPE_OPS)):
            kept.add(o.name)

    # upstream ops of every tensor / node, looking through bookkeeping (memoized, creation order)
    up_node: dict[str, dict[str, float]] = {}
    up_tensor: dict[str, dict[str, float]] = {}

    def merge(into: dict[str, float], src: dict[str, float], zero: bool) -> None:
        for k, b in src.items():
            b = 0.0 if zero else b
            if into.get(k, -1.0) < b:
                into[k] = b

    def control_up(o: Any) -> dict[str, float]:
        acc: dict[str, float] = {}
        for c in o.control_inputs:
            merge(acc, {c.name: 0.0} if c.name in kept else up_node[c.name], True)
        return acc

    for o in ops:
        if o.name in kept:
            up_node[o.name] = {}  # unused: a kept node is its own upstream
            for t in o.outputs:
                up_tensor[t.name] = {o.name: _nbytes(t)}
            continue
        ctrl = control_up(o)
        whole: dict[str, float] = dict(ctrl)
        for t in o.inputs:
            merge(whole, up_tensor.get(t.name, {}), True)
        up_node[o.name] = whole
        for t in o.outputs:
            # every input counts (a shape query waits for its input too, until Grappler folds it:
            # leaving it out lets a plan's control dependencies close a cycle); only a view's
            # data input carries its bytes
            acc = dict(whole)
            if o.type == "IdentityN":  # one node: output k waits for every input
                merge(acc, up_tensor.get(o.inputs[t.value_index].name, {}), False)
            elif o.type in VIEW_OPS and o.inputs and not const[o.name]:
                merge(acc, up_tensor.get(o.inputs[0].name, {}), False)
            up_tensor[t.name] = acc

    bounds = (marks.get("forward", 0), marks.get("backward", 0), marks.get("update", 0))
    phases: dict[str, str] = {}
    out_ops: list[Op] = []
    edges: list[Edge] = []
    for o in ops:
        if o.name not in kept:
            continue
        preds: dict[str, float] = {}
        read = params = 0.0
        for t in o.inputs:
            nbytes = _nbytes(t)
            read += nbytes
            src = up_tensor.get(t.name, {})
            if _reads_variable(t, resources):
                params += nbytes
            merge(preds, src, False)
        merge(preds, control_up(o), True)
        for p, b in preds.items():
            edges.append(Edge(p, o.name, float(b)))
        if o.type in WRITE_OPS:
            value = o.inputs[1]
            shape, dtype = _static(value, o.name), value.dtype.name
            written = _nbytes(value)
        else:
            outs = [t for t in o.outputs if t.dtype.name != "resource"]
            shape = _static(outs[0], o.name) if outs else ()
            dtype = outs[0].dtype.name if outs else "float32"
            written = sum(_nbytes(t) for t in outs)
        out_ops.append(Op(id=o.name, name=o.name, kind=_kind(o.type), flops=step_flops(o), bytes_read=read,
                          bytes_written=float(written), param_bytes=params, shape=shape, dtype=dtype))
        i = position[o.name]
        phases[o.name] = "forward" if i < bounds[0] else "backward" if i < bounds[1] else "update"
    if not out_ops:
        raise ModelImportError(f"the training step of {name!r} has no compute ops")
    from collections import Counter

    types = Counter(o.type for o in ops if o.name in kept)
    full_meta = {
        "framework": "tensorflow", "tf_version": _tf().__version__, "source": "tf.function",
        "inputs": [{"name": n, "shape": _static(fg.get_tensor_by_name(n), "feed"),
                    "dtype": fg.get_tensor_by_name(n).dtype.name} for n in feeds],
        "outputs": [fetch], "output_ops": sorted(up_tensor.get(fetch, {})),
        "tf_op_types": dict(sorted(types.items())), "tf_nodes": len(ops),
        "step": {"variables": len(step_vars), "trainable": sum(v.role == TRAINABLE for v in step_vars),
                 "optimizer_slots": sum(v.role == OPTIMIZER for v in step_vars),
                 "state_bytes": sum(v.nbytes for v in step_vars), "marks": dict(marks)},
        "phases": phases, **meta,
    }
    return OpGraph(tuple(out_ops), tuple(edges), name=name, meta=full_meta)


def coarsen_step(graph: OpGraph, max_ops: int) -> tuple[OpGraph, tuple]:
    """``graph`` with its ops grouped into at most about ``max_ops`` (the shipped policy plans at most
    4096), phase by phase: :func:`opsched.engine.coarsen.coarsen` on each phase's ops, cheapest safe
    contractions first (a BatchNorm's per-channel arithmetic folds into its neighbours; a chain
    becomes one op).  Within a phase that is acyclic in the whole graph too: a path that leaves a
    phase never comes back to it.  A group keeps its heaviest member's id (a TF node name) and its
    phase; the groups, with the members that start them (entries) and end them (exits), go to the
    source, so that the runtime places every member and puts a plan's waits on the ends."""
    from opsched.engine.coarsen import coarsen
    from opsched.phases import PHASES

    phases = dict(graph.meta["phases"])
    n = len(graph.ops)
    group_of: dict[str, str] = {}
    members_of: dict[str, list[str]] = {}
    for phase in PHASES:
        ids = [op.id for op in graph.ops if phases[op.id] == phase]
        if not ids:
            continue
        keep = set(ids)
        sub = OpGraph(tuple(graph.ops[graph.index[i]] for i in ids),
                      tuple(e for e in graph.edges if e.src in keep and e.dst in keep), name=f"{graph.name}/{phase}")
        budget = max(1, int(max_ops * len(ids) / n))
        co = coarsen(sub, budget)
        weight = [op.flops + op.bytes_total for op in sub.ops]
        for members in co.groups:
            lead = sub.ops[max(members, key=weight.__getitem__)].id
            members_of[lead] = [sub.ops[i].id for i in members]
            for i in members:
                group_of[sub.ops[i].id] = lead
    ops, groups = [], []
    for op in graph.ops:  # groups in the order of their lead's position
        if group_of[op.id] != op.id:
            continue
        mem = [graph.ops[graph.index[m]] for m in members_of[op.id]]
        ops.append(Op(id=op.id, name=op.name if len(mem) == 1 else f"{op.name} (+{len(mem) - 1} ops)",
                      kind=op.kind, flops=float(sum(o.flops for o in mem)),
                      bytes_read=float(sum(o.bytes_read for o in mem)),
                      bytes_written=float(sum(o.bytes_written for o in mem)),
                      param_bytes=float(sum(o.param_bytes for o in mem)), shape=op.shape, dtype=op.dtype))
        if len(mem) > 1:
            inside = set(members_of[op.id])
            entries = tuple(m.id for m in mem if not any(p in inside for p in graph.predecessors(m.id)))
            exits = tuple(m.id for m in mem if not any(q in inside for q in graph.successors(m.id)))
            groups.append((op.id, tuple(members_of[op.id]), entries, exits))
    agg: dict[tuple[str, str], float] = {}
    for e in graph.edges:
        a, b = group_of[e.src], group_of[e.dst]
        if a != b:
            agg[(a, b)] = agg.get((a, b), 0.0) + e.bytes
    meta = {**dict(graph.meta), "phases": {op.id: phases[op.id] for op in ops},
            "step": {**dict(graph.meta.get("step", {})), "ops_before_grouping": n, "grouped_ops": len(groups)},
            "output_ops": sorted({group_of[o] for o in graph.meta.get("output_ops", []) if o in group_of})}
    return OpGraph(tuple(ops), tuple(Edge(a, b, v) for (a, b), v in agg.items()), name=graph.name,
                   meta=meta), tuple(groups)


def _topological(ops: Sequence[Any]) -> list[Any]:
    """``ops`` in an order where every node follows its data and control inputs, creation order
    among ready nodes (creation order alone is not one: the returned loss gets its control
    inputs after the nodes they name were made)."""
    from opsched.graph import kahn_order

    pos = {o.name: i for i, o in enumerate(ops)}
    succ: list[list[int]] = [[] for _ in ops]
    indeg = dict.fromkeys(range(len(ops)), 0)
    for j, o in enumerate(ops):
        for i in {pos[t.op.name] for t in o.inputs} | {pos[c.name] for c in o.control_inputs}:
            succ[i].append(j)
            indeg[j] += 1
    order = kahn_order(indeg, succ)
    if len(order) != len(ops):  # pragma: no cover - TensorFlow graphs of a tf.function are acyclic
        raise ModelImportError("the traced step graph has a cycle")
    return [ops[i] for i in order]


def _reads_variable(t: Any, resources: set[str]) -> bool:
    """The tensor is a variable's value (a read, possibly through views)."""
    while t.op.type in VIEW_OPS and t.op.inputs:
        t = t.op.inputs[0]
    return t.op.type == "ReadVariableOp" and t.op.inputs and t.op.inputs[0].op.name in resources


__all__ = ["MAX_STEP_OPS", "OPTIMIZER", "STATE", "TRAINABLE", "KerasStepCapture", "StepVariable", "TFStepSource", "as_leaves",
           "capture_keras_step", "coarsen_step", "leaf_signature", "make_step", "resolve_loss", "step_flops"]
