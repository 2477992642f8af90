"""PyTorch importer: an ``nn.Module`` in, an :class:`~opsched.graph.OpGraph` out.

``from_torch(module, example_inputs)``

1. traces the module with ``torch.fx.symbolic_trace`` semantics (a tracer that
   records stack traces, so a failure names the module and source line);
2. runs the traced ``GraphModule`` once on the example inputs through
   ``ShapeProp`` (shapes and dtypes into ``node.meta["tensor_meta"]``) while a
   single ``torch.utils.flop_counter.FlopCounterMode`` is active, snapshotting
   its total around every node - so each node's FLOPs are exactly torch's own
   count and the graph's total equals FlopCounterMode's total for the model;
3. groups fx nodes into ops (grappler-style fusion, below) and fills the
   :class:`~opsched.graph.Op` fields and tensor-byte edges;
4. attaches a :class:`TorchSource` that a runtime executes op by op.

FLOPs are FlopCounterMode's: convolutions, matmuls and attention are counted,
elementwise/pooling/normalisation ops count 0 FLOPs.  Those ops are costed by
their bytes (the performance model is a roofline), which is what bounds them.

Fusion rule (why: schedulers should see compute ops, not bookkeeping).  A
*bookkeeping* node - ``getitem``, ``getattr``, ``size``/``dim``, views
(``view``, ``reshape``, ``flatten``, ``permute``, ``transpose``, ``unsqueeze``,
``squeeze``, ``expand``...), ``nn.Identity``/``nn.Flatten`` and ``nn.Dropout``
in eval mode - does no arithmetic.  It joins the op that produces its input
when all of its op-produced inputs come from that one op; a bookkeeping node
whose inputs are only graph inputs or constants joins its single consumer's
op.  Otherwise it stays an op of its own (kind ``other``).  Every other
``call_*`` node is the head of exactly one op, and every ``call_*`` node is
executed by exactly one op (``TorchSource.op_nodes``).  Graph inputs
(``placeholder``), constants/parameters (``get_attr``) and ``output`` are not
ops.  An op's id is its head fx node's name.

In-place ops (``x.relu_()``, ``operator.iadd``, modules or functions called
with ``inplace=True``) mutate a value other ops may read; the importer adds
zero-byte ordering edges (readers before the in-place op, the in-place op
before later readers) so a parallel runtime keeps eager semantics.  Mutation
through an alias (a view of the value) is not tracked: avoid in-place ops on
views in models meant for concurrent execution.

Slots (the flat value list of :meth:`TorchSource.compile_ops`): slot ``i`` for
``i < len(input_slots)`` is graph input ``i`` (``input_slots == (0, 1, ...)``);
then one slot per constant/parameter (``get_attr`` node), filled by
:meth:`TorchSource.new_values`; then one slot per ``call_*`` node in fx order.
``output_spec`` is the module's output structure with each value replaced by
:class:`Slot`.
"""

from __future__ import annotations

import builtins
import operator
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate, map_arg
from torch.fx.passes.shape_prop import ShapeProp, _extract_tensor_metadata
from torch.utils.flop_counter import FlopCounterMode

from opsched.errors import ModelImportError
from opsched.graph import Edge, Op, OpGraph

# ----------------------------------------------------------------- op kinds
_MODULE_KINDS: tuple[tuple[tuple[type, ...], str], ...] = (
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), "conv"),
    ((nn.Linear, nn.Bilinear), "matmul"),
    ((nn.MultiheadAttention,), "attention"),
    ((nn.RNNBase, nn.RNNCellBase), "rnn"),
    ((nn.Embedding, nn.EmbeddingBag), "embedding"),
    ((nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm), "norm"),
    (
        (
            nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
            nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
            nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
        ),
        "pool",
    ),
    ((nn.Softmax, nn.LogSoftmax), "reduce"),
)

# Name fragments of functions / methods, checked in order (first match wins).
_NAME_KINDS: tuple[tuple[str, str], ...] = (
    ("scaled_dot_product", "attention"),
    ("attention", "attention"),
    ("conv", "conv"),
    ("linear", "matmul"),
    ("matmul", "matmul"),
    ("einsum", "matmul"),
    ("bmm", "matmul"),
    ("addmm", "matmul"),
    ("mm", "matmul"),
    ("embedding", "embedding"),
    ("norm", "norm"),
    ("pool", "pool"),
    ("softmax", "reduce"),
    ("cat", "concat_split"),
    ("stack", "concat_split"),
    ("split", "concat_split"),
    ("chunk", "concat_split"),
    ("unbind", "concat_split"),
    ("sum", "reduce"),
    ("mean", "reduce"),
    ("amax", "reduce"),
    ("amin", "reduce"),
    ("max", "reduce"),
    ("min", "reduce"),
    ("prod", "reduce"),
    ("var", "reduce"),
    ("std", "reduce"),
    ("lstm", "rnn"),
    ("gru", "rnn"),
)

_ELEMENTWISE_NAMES = frozenset(
    "add sub mul truediv div floordiv mod pow neg abs exp log sqrt rsqrt sigmoid tanh relu relu6 gelu "
    "silu elu leaky_relu hardtanh hardswish hardsigmoid mish softplus clamp clip where maximum minimum "
    "dropout contiguous clone to type_as float half masked_fill erf sin cos iadd imul isub itruediv "
    "add_ mul_ sub_ div_ relu_ sigmoid_ tanh_ clamp_ addcmul addcdiv lerp".split()
)

# ------------------------------------------------------------- bookkeeping
_BOOKKEEPING_FUNCTIONS = {
    operator.getitem, builtins.getattr, torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze,
    torch.permute, torch.transpose, torch.t, torch.narrow, torch.select,
}
_BOOKKEEPING_METHODS = frozenset(
    "view view_as reshape reshape_as flatten unflatten size dim numel permute transpose t unsqueeze "
    "squeeze expand expand_as narrow select unfold detach".split()
)
_BOOKKEEPING_MODULES: tuple[type, ...] = (nn.Identity, nn.Flatten, nn.Unflatten)
_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.ipow, operator.iand, operator.ior, operator.ixor}

_TORCH_DIR = os.path.dirname(torch.__file__)


class Slot(NamedTuple):
    """A reference to a value slot inside ``TorchSource.output_spec``."""

    index: int


def output_slots(spec: Any) -> list[int]:
    """The value slots a ``TorchSource.output_spec`` (nested lists, tuples and
    dicts of :class:`Slot`) refers to, in no particular order."""
    out, stack = [], [spec]
    while stack:
        x = stack.pop()
        if isinstance(x, Slot):
            out.append(x.index)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


@dataclass(frozen=True)
class CompiledOp:
    """One op, ready to run: ``run(values)`` reads ``values[s]`` for ``s`` in
    ``reads`` and stores every value it computes into ``values[s]`` for ``s``
    in ``writes``.  ``run`` is generated Python (no fx interpretation)."""

    op_id: str
    run: Callable[[list], None]
    reads: tuple[int, ...]
    writes: tuple[int, ...]


@dataclass(eq=False)
class TorchSource:
    """What a real PyTorch backend needs to execute an imported graph.

    ``gm`` is the traced ``GraphModule``; ``op_nodes`` maps each op id to the
    fx node names it executes, in order; ``op_order`` lists op ids in graph op
    order.  See the module docstring for the slot layout.
    """

    gm: fx.GraphModule
    example_inputs: tuple
    op_nodes: dict[str, tuple[str, ...]]
    op_order: tuple[str, ...]
    slot_of: dict[str, int]
    input_slots: tuple[int, ...]
    const_slots: dict[int, str]
    output_spec: Any
    n_slots: int
    method_on_tensor: dict[str, bool] = field(default_factory=dict, repr=False)
    _compiled: list[CompiledOp] | None = field(default=None, repr=False)

    # ------------------------------------------------------------ values
    def new_values(self, *inputs: Any) -> list:
        """A fresh slot list with the graph inputs and constants filled in."""
        if len(inputs) != len(self.input_slots):
            raise ModelImportError(
                f"{type(self.gm).__name__}: expected {len(self.input_slots)} inputs, got {len(inputs)}"
            )
        values: list = [None] * self.n_slots
        for s, x in zip(self.input_slots, inputs, strict=True):
            values[s] = x
        for s, target in self.const_slots.items():
            values[s] = _fetch_attr(self.gm, target)
        return values

    def collect_output(self, values: list) -> Any:
        """Build the module's output structure from a filled slot list."""
        return _map_slots(self.output_spec, values)

    def compile_ops(self) -> list[CompiledOp]:
        """The ops as :class:`CompiledOp`, in graph op order (cached)."""
        if self._compiled is None:
            self._compiled = _compile(self)
        return list(self._compiled)

    def run_node_by_node(self, *inputs: Any) -> Any:
        """The plain sequential runner (compiled ops in graph order, which is
        topological, under ``torch.no_grad``) - the baseline a runtime's
        overhead is measured against.  Returns what ``module(*inputs)`` returns."""
        ops = self.compile_ops()
        values = self.new_values(*inputs)
        with torch.no_grad():
            for c in ops:
                c.run(values)
        return self.collect_output(values)


# ------------------------------------------------------------------ tracing
class _Tracer(fx.Tracer):
    """An fx tracer that records stack traces and where it was when it failed."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True
        self._where: list[str] = []
        self.failed_in: list[str] | None = None

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            path = self.path_of_module(m)
        except NameError:
            path = type(m).__name__
        self._where.append(f"{path or '<root>'} ({type(m).__name__})")
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = list(self._where)
            raise
        finally:
            self._where.pop()


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: 'file:line in func: code'."""
    here = os.path.abspath(__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_TORCH_DIR) and os.path.abspath(f.filename) != here]
    if not frames:
        return "unknown location"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def _trace(module: nn.Module, name: str) -> fx.GraphModule:
    tracer = _Tracer()
    try:
        graph = tracer.trace(module)
    except Exception as exc:
        where = " > ".join(tracer.failed_in) if tracer.failed_in else f"<root> ({type(module).__name__})"
        raise ModelImportError(
            f"cannot trace {name!r} with torch.fx: {type(exc).__name__}: {_first_line(exc)} "
            f"[in module {where}; at {_user_frame(exc)}]"
        ) from exc
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


# -------------------------------------------------- shape + FLOP propagation
class _Prop(ShapeProp):
    """ShapeProp that also records each node's FLOPs and output bytes."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # our errors already name the node
        self.counter = counter
        self.flops: dict[str, float] = {}
        self.out_bytes: dict[str, int] = {}
        self.first_tensor: dict[str, torch.Tensor] = {}
        self.is_tensor_self: dict[str, bool] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_method":
            a0 = n.args[0]
            self.is_tensor_self[n.name] = (isinstance(a0, fx.Node)
                                           and isinstance(self.env.get(a0), torch.Tensor))
        before = self.counter.get_total_flops()
        try:
            # Run through the plain Interpreter (ShapeProp's own run_node prints
            # a traceback to stderr before re-raising); record the metadata the
            # way ShapeProp does.
            result = fx.Interpreter.run_node(self, n)
        except Exception as exc:
            where = [f"at {_node_location(n)}"]
            if n.op == "call_module":
                sub = self.module.get_submodule(_path(n))
                where.insert(0, f"in module {n.target} ({type(sub).__name__})")
            raise ModelImportError(
                f"running fx node {n.name!r} ({n.format_node()}) on the example inputs failed: "
                f"{type(exc).__name__}: {_first_line(exc)} [{'; '.join(where)}]"
            ) from exc
        metas = map_aggregate(
            result, lambda x: _extract_tensor_metadata(x) if isinstance(x, torch.Tensor) else x
        )
        if _tensors(result):
            n.meta["tensor_meta"] = metas
        n.meta["type"] = type(result)
        self.flops[n.name] = float(self.counter.get_total_flops() - before)
        tensors = _tensors(result)
        self.out_bytes[n.name] = sum(t.numel() * t.element_size() for t in tensors)
        if tensors:
            self.first_tensor[n.name] = tensors[0]
        return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _path(n: fx.Node) -> str:
    """The target of a ``call_module`` / ``get_attr`` node (a dotted attribute path) or
    of a ``call_method`` node (the method's name): fx stores those as strings."""
    assert isinstance(n.target, str), n.format_node()
    return n.target


def _node_location(n: fx.Node) -> str:
    """The user's source line that created fx node ``n`` (from its stack trace)."""
    here = os.path.abspath(__file__)
    lines = (n.stack_trace or "").splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith("File ") and _TORCH_DIR not in line and here not in line:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return line.removeprefix("File ") + (f": {code}" if code else "")
    return "unknown location"


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


# ----------------------------------------------------------------- grouping
def _is_bookkeeping(n: fx.Node, gm: fx.GraphModule) -> bool:
    if n.op == "call_function":
        return n.target in _BOOKKEEPING_FUNCTIONS
    if n.op == "call_method":
        return n.target in _BOOKKEEPING_METHODS
    if n.op == "call_module":
        m = gm.get_submodule(_path(n))
        return isinstance(m, _BOOKKEEPING_MODULES) or (isinstance(m, nn.modules.dropout._DropoutNd) and not m.training)
    return False


def _is_inplace(n: fx.Node, gm: fx.GraphModule) -> bool:
    if n.op == "call_function":
        return n.target in _INPLACE_FUNCTIONS or n.kwargs.get("inplace") is True
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.endswith("__")
    if n.op == "call_module":
        return getattr(gm.get_submodule(_path(n)), "inplace", False) is True
    return False


def _group(gm: fx.GraphModule,
           bookkeeping: Callable[[fx.Node], bool] | None = None) -> dict[str, list[fx.Node]]:
    """Partition the call_* nodes into ops (see the module docstring).

    ``bookkeeping`` says which nodes do no arithmetic (default: this module's
    rule for ``torch.fx`` graphs; ``torch_aten`` passes its rule for aten graphs)."""
    is_bookkeeping = bookkeeping or (lambda n: _is_bookkeeping(n, gm))
    nodes = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    owner: dict[fx.Node, fx.Node] = {}  # node -> head node of its op
    pending: list[fx.Node] = []
    pending_set: set[fx.Node] = set()
    for n in nodes:
        if not is_bookkeeping(n):
            owner[n] = n
            continue
        heads = {owner[a] for a in n.all_input_nodes if a in owner}
        if len(heads) == 1:
            owner[n] = heads.pop()
        elif not heads and all(a.op in ("placeholder", "get_attr") or a in pending_set
                               for a in n.all_input_nodes):
            pending.append(n)
            pending_set.add(n)
        else:  # inputs from several ops: a standalone op
            owner[n] = n
    # Pending nodes read only graph inputs/constants: join their single consumer.
    for n in reversed(pending):
        users = {owner.get(u) for u in n.users}
        only = users.pop() if len(users) == 1 else None
        owner[n] = only if only is not None else n
    groups: dict[str, list[fx.Node]] = {}
    order = {n: i for i, n in enumerate(nodes)}
    for n in sorted(nodes, key=lambda x: (order[owner[x]], order[x])):
        groups.setdefault(owner[n].name, []).append(n)
    # Ops in order of their head node: topological, because an op's only
    # dependencies on other ops go through its head (fused bookkeeping reads
    # only its own op or graph inputs), and a head follows its inputs in fx order.
    heads = {n.name: order[n] for n in nodes}
    return dict(sorted(groups.items(), key=lambda kv: heads[kv[0]]))


def _kind(n: fx.Node, gm: fx.GraphModule) -> str:
    if n.op == "call_module":
        m = gm.get_submodule(_path(n))
        for types, kind in _MODULE_KINDS:
            if isinstance(m, types):
                return kind
        if isinstance(m, (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.LeakyReLU,
                          nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softplus, nn.modules.dropout._DropoutNd)):
            return "elementwise"
        tname = type(m).__name__.lower()
    else:
        tname = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        tname = tname.lower()
    if tname.strip("_") in _ELEMENTWISE_NAMES or tname in _ELEMENTWISE_NAMES:
        return "elementwise"
    for frag, kind in _NAME_KINDS:
        if frag in tname:
            return kind
    return "other"


def _display_name(n: fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    if n.op == "call_method":
        return f"{n.name} (.{n.target})"
    return f"{n.name} ({getattr(n.target, '__name__', str(n.target))})"


# ------------------------------------------------------------------ import
def from_torch(module: nn.Module, example_inputs: tuple, name: str | None = None) -> OpGraph:
    """Trace ``module`` and return its OpGraph (with a :class:`TorchSource`).

    Raises :class:`~opsched.errors.ModelImportError` when the module cannot be
    traced by torch.fx (data-dependent control flow, unsupported Python) or
    cannot run on ``example_inputs``; the message names the module and line.
    """
    if not isinstance(module, nn.Module):
        raise ModelImportError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise ModelImportError(
            f"from_torch expects example_inputs as a tuple of tensors, got {type(example_inputs).__name__}"
        )
    example_inputs = tuple(example_inputs)
    gname = name or type(module).__name__
    gm = _trace(module, gname)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise ModelImportError(
            f"{gname}: forward takes {len(placeholders)} inputs "
            f"({', '.join(p.name for p in placeholders)}) but {len(example_inputs)} example inputs were given"
        )

    counter = FlopCounterMode(display=False)
    prop = _Prop(gm, counter)
    # Clones: a model that writes into its inputs must not alter the caller's tensors.
    run_inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with torch.no_grad(), counter:
        prop.propagate(*run_inputs)

    groups = _group(gm)
    owner = {n: head for head, ns in groups.items() for n in ns}
    param_bytes_of: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            param_bytes_of[n.name] = prop.out_bytes.get(n.name, 0)

    ops: list[Op] = []
    edge_vals: dict[tuple[str, str], set[fx.Node]] = {}
    for head, ns in groups.items():
        members = set(ns)
        head_node = ns[0] if ns[0].name == head else next(n for n in ns if n.name == head)
        flops = sum(prop.flops.get(n.name, 0.0) for n in ns)
        pbytes = 0
        read_vals: set[fx.Node] = set()
        for n in ns:
            if n.op == "call_module":
                m = gm.get_submodule(_path(n))
                pbytes += sum(t.numel() * t.element_size() for t in m.parameters())
                pbytes += sum(t.numel() * t.element_size() for t in m.buffers())
            keeps = _is_bookkeeping(n, gm)  # views and size queries move no data
            for a in n.all_input_nodes:
                if a in members:
                    continue
                if a.op == "get_attr":
                    pbytes += 0 if keeps else param_bytes_of.get(a.name, 0)
                elif not keeps:
                    read_vals.add(a)
                if a in owner:
                    edge_vals.setdefault((owner[a], head), set()).add(a)
        written = sum(prop.out_bytes.get(n.name, 0) for n in ns if not _is_bookkeeping(n, gm))
        # The op's output: its last node that carries a tensor.
        out_t = next((prop.first_tensor[n.name] for n in reversed(ns) if n.name in prop.first_tensor), None)
        ops.append(
            Op(
                id=head,
                name=_display_name(head_node),
                kind=_kind(head_node, gm) if not _is_bookkeeping(head_node, gm) else "other",
                flops=flops,
                bytes_read=float(sum(prop.out_bytes.get(a.name, 0) for a in read_vals) + pbytes),
                bytes_written=float(written),
                param_bytes=float(pbytes),
                shape=tuple(int(d) for d in out_t.shape) if out_t is not None else (),
                dtype=str(out_t.dtype).removeprefix("torch.") if out_t is not None else "none",
            )
        )
    edges = [
        Edge(src, dst, float(sum(prop.out_bytes.get(v.name, 0) for v in vals)))
        for (src, dst), vals in edge_vals.items()
    ]
    edges += _inplace_edges(gm, owner, {e[:2] for e in ((x.src, x.dst) for x in edges)})

    source = _make_source(gm, example_inputs, groups)
    source.method_on_tensor = dict(prop.is_tensor_self)
    meta = {
        "source": "torch.fx",
        "module": type(module).__name__,
        "inputs": [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs],
        "fx_nodes": sum(len(v) for v in groups.values()),
    }
    graph = OpGraph(tuple(ops), tuple(edges), name=gname, meta=meta)
    return graph.with_source(source)


def _inplace_edges(gm: fx.GraphModule, owner: dict[fx.Node, str], existing: set[tuple[str, str]]) -> list[Edge]:
    """Zero-byte ordering edges that keep eager semantics around in-place ops."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    head_pos = {n.name: order[n] for n in gm.graph.nodes}
    out: list[Edge] = []
    for n in gm.graph.nodes:
        if not n.op.startswith("call_") or not _is_inplace(n, gm) or not n.args:
            continue
        target = n.args[0]
        if not isinstance(target, fx.Node):
            continue
        me = owner[n]
        for u in target.users:
            if u is n or u not in owner or owner[u] == me:
                continue
            pair = (owner[u], me) if order[u] < order[n] else (me, owner[u])
            # Only edges that agree with the op order (head positions), which
            # keeps the graph acyclic; a reader fused into the producer of the
            # mutated value runs before the mutation anyway.
            if head_pos[pair[0]] < head_pos[pair[1]] and pair not in existing:
                existing.add(pair)
                out.append(Edge(pair[0], pair[1], 0.0))
    return out


# ------------------------------------------------------------- compilation
def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _map_slots(spec: Any, values: list) -> Any:
    if isinstance(spec, Slot):
        return values[spec.index]
    if isinstance(spec, tuple) and type(spec) is not tuple and hasattr(spec, "_fields"):
        return type(spec)(*(_map_slots(s, values) for s in spec))
    if isinstance(spec, (tuple, list)):
        return type(spec)(_map_slots(s, values) for s in spec)
    if isinstance(spec, dict):
        return {k: _map_slots(v, values) for k, v in spec.items()}
    return spec


def _make_source(gm: fx.GraphModule, example_inputs: tuple, groups: dict[str, list[fx.Node]]) -> TorchSource:
    slot_of: dict[str, int] = {}
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op == "placeholder":
            slot_of[n.name] = len(slot_of)
    n_inputs = len(slot_of)
    const_slots: dict[int, str] = {}
    for n in nodes:
        if n.op == "get_attr":
            slot_of[n.name] = len(slot_of)
            const_slots[slot_of[n.name]] = str(n.target)
    for n in nodes:
        if n.op.startswith("call_"):
            slot_of[n.name] = len(slot_of)
    out_node = next(n for n in nodes if n.op == "output")
    output_spec = map_arg(out_node.args[0], lambda a: Slot(slot_of[a.name]))
    return TorchSource(
        gm=gm,
        example_inputs=example_inputs,
        op_nodes={h: tuple(n.name for n in ns) for h, ns in groups.items()},
        op_order=tuple(groups),
        slot_of=slot_of,
        input_slots=tuple(range(n_inputs)),
        const_slots=const_slots,
        output_spec=output_spec,
        n_slots=len(slot_of),
    )


class _CodeGen:
    """Renders fx node calls as Python source over the slot list ``v``."""

    def __init__(self, gm: fx.GraphModule, slot_of: dict[str, int]) -> None:
        self.gm = gm
        self.slot_of = slot_of
        self.globals: dict[str, Any] = {}

    def const(self, value: Any) -> str:
        if value is None or isinstance(value, (bool, str)) or (type(value) is int):
            return repr(value)
        name = f"_k{len(self.globals)}"
        self.globals[name] = value
        return name

    def expr(self, a: Any) -> str:
        if isinstance(a, fx.Node):
            return f"v[{self.slot_of[a.name]}]"
        if isinstance(a, tuple) and type(a) is not tuple and hasattr(a, "_fields"):
            return f"{self.const(type(a))}({', '.join(self.expr(x) for x in a)})"
        if isinstance(a, tuple):
            return "(" + "".join(self.expr(x) + ", " for x in a) + ")"
        if isinstance(a, list):
            return "[" + ", ".join(self.expr(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{self.const(k)}: {self.expr(x)}" for k, x in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.expr(a.start)}, {self.expr(a.stop)}, {self.expr(a.step)})"
        return self.const(a)

    def call(self, n: fx.Node, tensor_self: bool) -> str:
        args = [self.expr(a) for a in n.args]
        kwargs = [f"{k}={self.expr(x)}" if k.isidentifier() else f"**{{{k!r}: {self.expr(x)}}}"
                  for k, x in n.kwargs.items()]
        if n.op == "call_module":
            fn = self.const(self.gm.get_submodule(_path(n)))
        elif n.op == "call_function":
            fn = self.const(n.target)
        else:  # call_method
            meth = getattr(torch.Tensor, _path(n), None) if tensor_self else None
            if meth is not None:
                fn = self.const(meth)
            else:
                fn = f"{args[0]}.{n.target}"
                args = args[1:]
        return f"v[{self.slot_of[n.name]}] = {fn}({', '.join(args + kwargs)})"


def _compile(src: TorchSource) -> list[CompiledOp]:
    gm = src.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    tensor_self = src.method_on_tensor
    out: list[CompiledOp] = []
    for op_id in src.op_order:
        names = src.op_nodes[op_id]
        cg = _CodeGen(gm, src.slot_of)
        lines = [cg.call(by_name[nm], tensor_self.get(nm, True)) for nm in names]
        members = set(names)
        reads = sorted({src.slot_of[a.name] for nm in names for a in by_name[nm].all_input_nodes
                        if a.name not in members})
        writes = tuple(src.slot_of[nm] for nm in names)
        code = "def run(v):\n" + "".join(f"    {ln}\n" for ln in lines)
        ns: dict[str, Any] = dict(cg.globals)
        exec(compile(code, f"<opsched op {op_id}>", "exec"), ns)  # noqa: S102 - our own generated code
        run = ns["run"]
        run.__doc__ = code
        out.append(CompiledOp(op_id=op_id, run=run, reads=tuple(reads), writes=writes))
    return out
