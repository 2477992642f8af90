"""Aten-level capture: ``make_fx`` over a functionalized function, grouped into an OpGraph.

Two importers use it: the training-step capture (:func:`opsched.importers.torch_step.capture_step`)
and :func:`capture_inference`, the fallback for models that ``torch.fx`` symbolic
tracing cannot handle (``torch.fx`` runs Python on proxies, so item assignment
on a proxy, ``len()`` of one or a data-dependent branch stops it; ``make_fx``
runs the real Python on fake tensors and records the aten ops that come out).

How a function becomes an OpGraph:

1. :func:`trace_functional` runs ``make_fx(functionalize(fn, remove="mutations_and_views"))``
   on *fake* tensors (no arithmetic is done, and a Python branch on a tensor's
   value fails instead of silently freezing one branch), with the Python
   dispatcher on - as AOTAutograd does, so ``native_batch_norm`` becomes
   ``_native_batch_norm_legit_functional``, whose new running statistics are
   outputs rather than hidden writes into its inputs - and with
   ``torch.fx.traceback.preserve_node_meta`` so that ``annotate({...})`` blocks
   inside ``fn`` (the step's phases) land in ``node.meta["custom"]``.
   ``keep_views=True`` (the exact training step) functionalizes mutations only
   and keeps the view ops: autograd chooses some backward formulas by the
   operands' strides (a Linear's weight gradient is ``grad.t() @ x`` because
   the weight enters transposed), and a ``*_copy`` op's fake output is
   contiguous, so with views removed the trace takes the other formula,
   ``(x.t() @ grad).t()`` - the same sums in another GEMM, bitwise equal to
   eager on the Intel Xeon of earlier CI runs, not on an AMD EPYC.
2. :func:`functional_cleanup` removes functionalization's epilogue (the
   ``copy_`` of a new value into a mutated input; the caller gets the mapping
   input -> new value and decides what is allowed), refuses any other mutating
   op, and turns the ``*_copy`` view ops back into views (``view_copy`` ->
   ``view``, ``t_copy`` -> ``t``): with no mutation left an alias is
   unobservable, and a view is free where a copy moves the whole tensor (a
   transposed weight, a reshaped activation) - which is also what eager runs.
3. :func:`build_opgraph` groups the aten nodes into ops with ``torch_fx``'s
   rule (bookkeeping here: ``getitem`` and single-output view ops), runs the
   graph once on fake tensors under ``FlopCounterMode`` for per-op FLOPs (the
   same counter ``torch_fx`` uses: conv/matmul/attention and their backward
   ops are counted, elementwise ops count 0 and are costed by bytes), sizes
   every op and edge, and attaches an :class:`AtenSource` - a
   :class:`~opsched.importers.torch_fx.TorchSource`, so the torch CPU runtime
   runs it unchanged.

Random ops (``torch.Tag.nondeterministic_seeded``: dropout's ``bernoulli``,
``rand_like``...) are kept and chained by zero-byte edges in trace order, so
every valid plan runs them in eager's order; they draw from torch's default
CPU generator as eager does, so a run after ``torch.manual_seed(s)`` gives
eager's numbers (the *RNG rule*; tested for dropout).  Only the *order* of the
draws is fixed: ops that co-run with them may run on any thread.
"""

from __future__ import annotations

import operator
import os
import re
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from opsched.errors import ModelImportError
from opsched.graph import Edge, Op, OpGraph
from opsched.importers.torch_fx import (
    _ELEMENTWISE_NAMES,
    _NAME_KINDS,
    Slot,
    TorchSource,
    _first_line,
    _group,
    _make_source,
    _Prop,
)

aten = torch.ops.aten
_OpOverload = torch._ops.OpOverload

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE_DIR = os.path.dirname(os.path.abspath(__file__))

#: Views whose schema does not say so (they alias their input all the same).
_UNANNOTATED_VIEWS = frozenset({aten._unsafe_view.default, aten.reshape.default})

#: Aten base names (after dropping ``_backward``/``_functional``...) that are elementwise.
_ATEN_ELEMENTWISE = frozenset(
    "threshold rsub sign eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and "
    "bitwise_or bitwise_not ones_like zeros_like empty_like full_like full zeros ones fill scalar_tensor "
    "copy to_copy bernoulli native_dropout rand_like randn_like reciprocal square log_sigmoid tril triu "
    "hardswish hardsigmoid elu silu gelu mish softplus leaky_relu hardtanh sigmoid tanh relu isnan isinf "
    "nan_to_num".split()
)
#: Name fragments for aten ops that torch_fx's table does not cover, checked first.
_ATEN_FRAGMENTS: tuple[tuple[str, str], ...] = (
    ("dropout", "elementwise"),
    ("loss", "reduce"),
    ("cumsum", "reduce"),
    ("scatter", "concat_split"),
)
#: Marks a tensor's place among a module's output leaves.
_TENSOR = object()
_SUFFIXES = ("_backward_data", "_backward", "_forward", "_functional", "_with_indices", "_legit", "_no_training")


# ------------------------------------------------------------------ tracing
def user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and opsched's importers: 'file:line in func: code'."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith((_TORCH_DIR, "<"))
              and os.path.dirname(os.path.abspath(f.filename)) != _HERE_DIR]
    if not frames:
        return "unknown location"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def node_location(n: fx.Node) -> str:
    """The user's source line that created aten node ``n`` (from make_fx's recorded
    stack), as 'file:line in func: code' like :func:`user_frame`."""
    lines = (n.meta.get("stack_trace") or "").splitlines()
    found = "unknown location"
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if m and not m["file"].startswith((_TORCH_DIR, "<")) and os.path.dirname(m["file"]) != _HERE_DIR:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found = f"{m['file']}:{m['line']} in {m['func']}" + (f": {code}" if code else "")  # innermost wins
    return found


def _explain(exc: BaseException) -> str:
    """The exception's type and first line, with what it means for a capture."""
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    name = type(exc).__name__
    if "DataDependent" in name or "data-dependent" in str(exc).lower() or "_local_scalar_dense" in str(exc):
        return (text + " - data-dependent control flow or a tensor value read on the host (.item(), "
                "bool(tensor), an `if` on a tensor): a captured graph must run the same ops for every input")
    if "DynamicOutputShape" in name:
        return (text + " - an op whose output shape depends on the data (nonzero, masked_select, unique...): "
                "a captured graph must run the same ops for every input")
    return text


def trace_functional(fn: Callable[..., Any], flat_inputs: Sequence[Any], what: str,
                     two_stage: bool = False, keep_views: bool = False) -> fx.GraphModule:
    """``make_fx(functionalize(fn))`` on fake tensors, phases and stack traces kept
    (see the module docstring); any failure is a :class:`ModelImportError` naming
    ``what``, the cause and the user's source line.

    ``two_stage``: first ``make_fx(fn)`` without functionalization, so that
    ``fn`` sees plain ``FakeTensor`` inputs - libraries that ask "am I being
    traced?" (HuggingFace's ``is_tracing`` checks ``isinstance(x, FakeTensor)``)
    then take their trace-safe path instead of reading a tensor's value, as
    under ``torch.export`` - then functionalize that aten graph in a second
    trace (node metadata carried over).  Not for training steps: under
    ``grad`` the inputs are wrapped whatever the stage.

    ``keep_views``: functionalize mutations only, so view ops stay views and
    autograd sees eager's strides (see the module docstring).
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    def functional(f: Callable[..., Any]) -> Callable[..., fx.GraphModule]:
        remove = "mutations" if keep_views else "mutations_and_views"
        return make_fx(torch.func.functionalize(f, remove=remove), tracing_mode="fake",
                       _allow_non_fake_inputs=True, record_stack_traces=True)

    if two_stage:
        def traced(*args: Any) -> fx.GraphModule:
            stage1 = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True, record_stack_traces=True)(*args)
            return functional(lambda *a: fx.Interpreter(stage1).run(*a))(*args)
    else:
        traced = functional(fn)
    # make_fx keys inputs by identity: one tensor passed twice would become one
    # placeholder, so repeats are traced on stand-ins (only shapes matter here).
    seen: set[int] = set()
    distinct = []
    for x in flat_inputs:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                x = torch.empty_like(x)
            seen.add(id(x))
        distinct.append(x)
    with torch.random.fork_rng(devices=[]), fx_traceback.preserve_node_meta(), enable_python_dispatcher():
        try:
            return traced(*distinct)
        except ModelImportError:
            raise
        except Exception as exc:
            raise ModelImportError(f"cannot capture {what} with make_fx: {_explain(exc)} [at {user_frame(exc)}]"
                                   ) from exc


#: Ops whose view is valid only for some strides: replayed as ``reshape`` (a view
#: when the strides allow, else a copy - what eager's ``reshape`` does), because
#: functionalization decided "view" on the strides of copies, not of views.
_AS_RESHAPE = frozenset({aten.view_copy.default, aten.view.default, aten._unsafe_view.default})
#: Views that interpret raw strides: they stay copies (exact on the functional values).
_KEEP_COPY = frozenset({"as_strided_copy", "as_strided_scatter"})


def _view_of(target: _OpOverload) -> _OpOverload | None:
    """The view op to run for a functionalized ``*_copy`` op (``t_copy.default`` ->
    ``t.default``, ``view_copy.default`` -> ``reshape.default``), or None to keep it."""
    if target in _AS_RESHAPE:
        return aten.reshape.default
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_copy") or name in _KEEP_COPY:
        return None
    packet = getattr(aten, name[: -len("_copy")], None)
    op = getattr(packet, target._overloadname, None) if packet is not None else None
    return op if isinstance(op, _OpOverload) and op.is_view else None


def functional_cleanup(gm: fx.GraphModule, what: str) -> dict[str, fx.Node]:
    """Drop functionalization's write-back epilogue, refuse leftover mutation,
    turn ``*_copy`` views back into views, drop dead nodes.  Returns
    placeholder name -> the node holding that input's new value."""
    graph = gm.graph
    mutated: dict[str, fx.Node] = {}
    for n in list(graph.nodes):
        if (n.op == "call_function" and n.target is aten.copy_.default and isinstance(n.args[0], fx.Node)
                and n.args[0].op == "placeholder"):
            mutated[n.args[0].name] = n.args[1]
            n.replace_all_uses_with(n.args[1])
            graph.erase_node(n)
    for n in graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, _OpOverload):
            continue
        if torch.Tag.data_dependent_output in n.target.tags:
            raise ModelImportError(f"cannot capture {what}: op {n.target} reads a tensor value on the host "
                                   "(.item(), .tolist(), bool(tensor)); a captured graph must run the same ops "
                                   f"for every input [at {node_location(n)}]")
        if n.target._schema.is_mutable:
            raise ModelImportError(f"cannot capture {what}: op {n.target} still writes into its input after "
                                   f"functionalization [at {node_location(n)}]")
        view = _view_of(n.target)
        if view is not None and view is not n.target:
            n.target = view
    graph.eliminate_dead_code()
    gm.recompile()
    return mutated


def split_conv_backward(gm: fx.GraphModule) -> int:
    """Split every ``convolution_backward`` that computes the input gradient and
    the weight (and bias) gradient into two nodes, one for each.

    Why: the input gradient is on the critical path of the backward pass; the
    weight gradient feeds only its parameter's update.  As one aten op they
    would be one op of the graph, run one after the other inside it; split,
    a plan can co-run them.  Each half is the same kernel call with the other
    outputs masked off (torch computes them separately anyway), so the numbers
    do not change.  Returns how many nodes were split.
    """
    graph = gm.graph
    count = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.convolution_backward.default:
            continue
        mask = list(n.args[10])
        if not (mask[0] and (mask[1] or mask[2])):
            continue
        with graph.inserting_before(n):
            grad_in = graph.call_function(n.target, (*n.args[:10], [True, False, False]))
            grad_w = graph.call_function(n.target, (*n.args[:10], [False, mask[1], mask[2]]))
        for half in (grad_in, grad_w):
            half.meta = {k: v for k, v in n.meta.items() if k != "val"}
        for u in list(n.users):
            if u.target is not operator.getitem:
                raise ModelImportError(f"unexpected use of {n.name} by {u.format_node()}")
            u.args = (grad_in if u.args[1] == 0 else grad_w, u.args[1])
        graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
    return count


def random_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that draw from a random generator, in trace order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, _OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags]


# ------------------------------------------------------------ op grouping
def aten_bookkeeping(n: fx.Node) -> bool:
    """A node that does no arithmetic: ``getitem`` or a single-output view op."""
    if n.op != "call_function":
        return False
    t = n.target
    if t is operator.getitem:
        return True
    if not isinstance(t, _OpOverload):
        return False
    if t in _UNANNOTATED_VIEWS:
        return True
    rets = t._schema.returns
    return t.is_view and len(rets) == 1 and str(rets[0].type) == "Tensor"


def aten_kind(target: Any) -> str:
    """The canonical op kind of an aten op (``convolution_backward`` -> conv, ``addmm`` -> matmul...)."""
    if not isinstance(target, _OpOverload):
        return "other"
    base = target._schema.name.split("::")[-1].strip("_")
    core = base
    changed = True
    while changed:
        changed = False
        for suffix in _SUFFIXES:
            if core.endswith(suffix):
                core, changed = core[: -len(suffix)], True
    core = core.strip("_")
    if core in _ATEN_ELEMENTWISE or core in _ELEMENTWISE_NAMES:
        return "elementwise"
    for frag, kind in _ATEN_FRAGMENTS + _NAME_KINDS:
        if frag in base:
            return kind
    return "other"


def _aten_name(n: fx.Node) -> str:
    t = n.target
    label = t._schema.name.split("::")[-1] if isinstance(t, _OpOverload) else getattr(t, "__name__", str(t))
    return f"{n.name} ({label})"


# ------------------------------------------------------------ the source
@dataclass(eq=False)
class AtenSource(TorchSource):
    """A :class:`TorchSource` over a make_fx graph.  ``output_spec`` is the flat
    list of outputs (Slots, or constants for non-tensor outputs); ``out_tree``,
    when set, rebuilds the module's own output structure from it."""

    out_tree: Any = field(default=None, repr=False)

    def collect_output(self, values: list) -> Any:
        flat = [values[s.index] if isinstance(s, Slot) else s for s in self.output_spec]
        return flat if self.out_tree is None else pytree.tree_unflatten(flat, self.out_tree)


class _AtenProp(_Prop):
    """torch_fx's FLOP/shape propagation; a view's bytes are capped by its storage
    (an ``expand`` of a scalar moves one number, not the expanded size)."""

    what = "the graph"

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except ModelImportError as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            raise ModelImportError(f"cannot capture {self.what}: op {n.target} failed on fake tensors: "
                                   f"{_explain(cause)} [at {node_location(n)}]") from cause
        if aten_bookkeeping(n) and isinstance(result, torch.Tensor):
            try:
                self.out_bytes[n.name] = min(self.out_bytes[n.name], result.untyped_storage().nbytes())
            except (RuntimeError, NotImplementedError):
                pass
        return result


def _fake_propagate(gm: fx.GraphModule, flat_inputs: Sequence[Any], what: str) -> _Prop:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
    counter = FlopCounterMode(display=False)
    prop = _AtenProp(gm, counter)
    prop.what = what
    with torch.no_grad(), mode, counter:
        prop.propagate(*fake)
    return prop


@dataclass
class Captured:
    """What :func:`build_opgraph` returns: the graph (with its source) and the node grouping."""

    graph: OpGraph
    source: AtenSource
    groups: dict[str, list[fx.Node]]


def _merge_groups(gm: fx.GraphModule, groups: dict[str, list[fx.Node]],
                  merge_key: Callable[[fx.Node], Any]) -> dict[str, list[fx.Node]]:
    """Fuse the ops whose head nodes share a ``merge_key`` (not None) into the first
    of them.  The caller guarantees that this keeps the op order topological
    (e.g. one parameter's update: its nodes read only earlier phases and each other)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    out: dict[str, list[fx.Node]] = {}
    first: dict[Any, str] = {}
    for head, ns in groups.items():
        key = merge_key(by_name[head])
        if key is None:
            out[head] = ns
        elif key in first:
            out[first[key]] = sorted(out[first[key]] + ns, key=order.__getitem__)
        else:
            first[key] = head
            out[head] = list(ns)
    return out


def build_opgraph(gm: fx.GraphModule, flat_inputs: Sequence[Any], name: str, meta: dict[str, Any],
                  persistent: Collection[str] = frozenset(), phase_of: Callable[[fx.Node], str] | None = None,
                  out_tree: Any = None, merge_key: Callable[[fx.Node], Any] | None = None,
                  order: Sequence[tuple[fx.Node, fx.Node]] = ()) -> Captured:
    """Group ``gm``'s nodes into ops and build the OpGraph with an :class:`AtenSource`.

    ``persistent`` names the placeholders that hold model state (parameters,
    buffers, optimizer state): reading them counts as ``param_bytes``, as
    reading a ``get_attr`` constant does.  ``phase_of`` gives each op's phase
    (from its head node), stored in ``meta["phases"]``.  Ops whose head nodes
    share a ``merge_key`` become one op (see :func:`_merge_groups`).  ``order``:
    (a, b) node pairs whose ops must run a before b though no value flows between
    them (a write in place after the last read), as zero-byte edges.
    """
    prop = _fake_propagate(gm, flat_inputs, f"{name!r}")
    groups = _group(gm, aten_bookkeeping)
    if merge_key is not None:
        groups = _merge_groups(gm, groups, merge_key)
    owner = {n: head for head, ns in groups.items() for n in ns}
    by_name = {n.name: n for n in gm.graph.nodes}

    def state_base(a: fx.Node) -> fx.Node | None:
        """The persistent tensor that ``a`` is (a view of), if any."""
        while True:
            if a.op == "get_attr" or (a.op == "placeholder" and a.name in persistent):
                return a
            if not aten_bookkeeping(a) or not isinstance(a.args[0], fx.Node):
                return None
            a = a.args[0]

    ops: list[Op] = []
    edge_vals: dict[tuple[str, str], set[fx.Node]] = {}
    for head, ns in groups.items():
        members = set(ns)
        head_node = by_name[head]
        state_read: set[fx.Node] = set()
        read_vals: set[fx.Node] = set()
        for n in ns:
            keeps = aten_bookkeeping(n)  # views move no data
            for a in n.all_input_nodes:
                if a in members:
                    continue
                if a in owner:
                    edge_vals.setdefault((owner[a], head), set()).add(a)
                if keeps:
                    continue
                base = state_base(a)
                if base is not None:
                    state_read.add(base)
                else:
                    read_vals.add(a)
        pbytes = sum(prop.out_bytes.get(a.name, 0) for a in state_read)
        written = sum(prop.out_bytes.get(n.name, 0) for n in ns if not aten_bookkeeping(n))
        out_t = next((prop.first_tensor[n.name] for n in reversed(ns) if n.name in prop.first_tensor), None)
        ops.append(Op(
            id=head,
            name=_aten_name(head_node),
            kind="other" if aten_bookkeeping(head_node) else aten_kind(head_node.target),
            flops=sum(prop.flops.get(n.name, 0.0) for n in ns),
            bytes_read=float(sum(prop.out_bytes.get(a.name, 0) for a in read_vals) + pbytes),
            bytes_written=float(written),
            param_bytes=float(pbytes),
            shape=tuple(int(d) for d in out_t.shape) if out_t is not None else (),
            dtype=str(out_t.dtype).removeprefix("torch.") if out_t is not None else "none",
        ))
    edges = [Edge(src, dst, float(sum(prop.out_bytes.get(v.name, 0) for v in vals)))
             for (src, dst), vals in edge_vals.items()]
    # The RNG rule: random ops run in trace (= eager) order under every plan.
    chain = [owner[n] for n in random_nodes(gm)]
    have = set(edge_vals)
    for a, b in zip(chain, chain[1:]):
        if a != b and (a, b) not in have:
            have.add((a, b))
            edges.append(Edge(a, b, 0.0))
    for a, b in order:
        pair = (owner.get(a), owner.get(b))
        if None not in pair and pair[0] != pair[1] and pair not in have:
            have.add(pair)  # type: ignore[arg-type]
            edges.append(Edge(pair[0], pair[1], 0.0))  # type: ignore[arg-type]
    meta = dict(meta)
    meta["aten_nodes"] = sum(len(v) for v in groups.values())
    meta["random_ops"] = list(dict.fromkeys(chain))
    if phase_of is not None:
        meta["phases"] = {head: phase_of(by_name[head]) for head in groups}
    graph = OpGraph(tuple(ops), tuple(edges), name=name, meta=meta)
    base = _make_source(gm, tuple(flat_inputs), groups)
    source = AtenSource(**{f.name: getattr(base, f.name) for f in fields(TorchSource)}, out_tree=out_tree)
    return Captured(graph.with_source(source), source, groups)


# ------------------------------------------------------------ checks
def check_capturable(module: nn.Module, what: str) -> None:
    """Refuse what a functional capture cannot honour: hooks (they would run once,
    at capture, on fake tensors) and sparse gradients."""
    from torch.nn.modules import module as module_mod

    for kind in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(module_mod, kind, None):
            raise ModelImportError(f"cannot capture {what}: a global module hook is registered "
                                   f"(torch.nn.modules.module.{kind}); remove it or run eagerly")
    for path, m in module.named_modules():
        where = f"{path or '<root>'} ({type(m).__name__})"
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            hooks = getattr(m, kind, None)
            if hooks:
                fn = next(iter(hooks.values()))
                raise ModelImportError(f"cannot capture {what}: module {where} has a {kind[1:-1].replace('_', ' ')} "
                                       f"({getattr(fn, '__qualname__', fn)!r}); hooks run Python the captured "
                                       "graph cannot replay - remove it or run eagerly")
        if getattr(m, "sparse", False) is True:
            raise ModelImportError(f"cannot capture {what}: module {where} has sparse=True (sparse gradients are "
                                   "not supported; use sparse=False or run eagerly)")
    for pname, p in module.named_parameters():
        if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
            raise ModelImportError(f"cannot capture {what}: parameter {pname!r} has a gradient hook; "
                                   "remove it or run eagerly")
        if p.is_sparse or p.is_complex():
            raise ModelImportError(f"cannot capture {what}: parameter {pname!r} is "
                                   f"{'sparse' if p.is_sparse else 'complex'}, which is not supported")


# ------------------------------------------------------------ inference
def capture_inference(module: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None = None,
                      name: str | None = None) -> OpGraph:
    """Import ``module``'s forward at the aten level (make_fx), for models that
    ``torch.fx`` symbolic tracing cannot handle.

    ``example_inputs`` is a tensor or a tuple of positional inputs,
    ``example_kwargs`` keyword inputs; every tensor among them is a graph input
    (in that order: positional, then keyword values), everything else is
    fixed at capture.  Parameters and buffers are the module's own tensors
    (read when the graph runs, so later weight updates are seen).  The source's
    ``collect_output`` returns the module's output structure.  A module that
    writes into its buffers (train-mode BatchNorm) is refused: capture it in
    eval mode, or capture a training step with ``capture_step``.
    """
    if not isinstance(module, nn.Module):
        raise ModelImportError(f"capture_inference expects a torch.nn.Module, got {type(module).__name__}")
    gname = name or type(module).__name__
    what = f"the forward of {gname!r}"
    check_capturable(module, what)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    is_t = [isinstance(x, torch.Tensor) for x in leaves]
    xs = [x for x, t in zip(leaves, is_t) if t]
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    n_p, n_b = len(params), len(buffers)
    out_info: dict[str, Any] = {}

    def forward(*flat: Any) -> list:
        ps = dict(zip(params, flat[:n_p]))
        bs = dict(zip(buffers, flat[n_p:n_p + n_b]))
        it = iter(flat[n_p + n_b:])
        a, k = pytree.tree_unflatten([next(it) if t else x for x, t in zip(leaves, is_t)], in_spec)
        with torch.no_grad():
            out = torch.func.functional_call(module, (ps, bs), a, k)
        out_leaves, spec = pytree.tree_flatten(out)
        out_info["spec"] = spec
        out_info["template"] = [_TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]
        return [x for x in out_leaves if isinstance(x, torch.Tensor)]

    state = [p.detach() for p in params.values()] + list(buffers.values())
    gm = trace_functional(forward, state + xs, what, two_stage=True)
    mutated = functional_cleanup(gm, what)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = list(params) + list(buffers)
    if mutated:
        first = next(iter(mutated))
        pos = [p.name for p in placeholders].index(first)
        label = f"buffer/parameter {names[pos]!r}" if pos < len(names) else f"input {pos - len(names)}"
        raise ModelImportError(f"cannot capture {what} for inference: the forward writes into {label} "
                               "(train-mode BatchNorm does); call module.eval() first, or capture a training "
                               "step with opsched.importers.torch_step.capture_step")
    # Model state becomes get_attr constants that reference the module's own tensors.
    first_node = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for i, (ph, key) in enumerate(zip(placeholders, names)):
        attr = f"_opsched_state_{i}"
        t = params.get(key) if i < n_p else buffers[key]
        if isinstance(t, nn.Parameter):
            gm.register_parameter(attr, t)
        else:
            gm.register_buffer(attr, t, persistent=False)
        with gm.graph.inserting_before(first_node):
            ga = gm.graph.get_attr(attr)
        ph.replace_all_uses_with(ga)
        gm.graph.erase_node(ph)
    gm.recompile()
    # Non-tensor outputs are constants in the flat output list.
    template = out_info["template"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    tensor_outs = iter(out_node.args[0])
    out_node.args = ([next(tensor_outs) if x is _TENSOR else x for x in template],)
    gm.recompile()
    meta = {
        "source": "make_fx",
        "module": type(module).__name__,
        "inputs": [list(x.shape) for x in xs],
    }
    cap = build_opgraph(gm, xs, gname, meta, out_tree=out_info["spec"])
    return cap.graph
