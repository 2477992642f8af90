"""Capture a PyTorch training step - forward, loss, backward, optimizer update - as one OpGraph.

    graph = capture_step(module, loss_fn, optimizer, example_x, example_y)
    step = StepRunner(graph, module, optimizer)
    for x, y in data:
        loss = step(x, y)                      # sequential replay, or:
        loss = step(x, y, execute=lambda inputs: backend.execute(graph, plan, inputs))

``step(x, y)`` does what ``optimizer.zero_grad(); loss = loss_fn(module(x), y);
loss.backward(); optimizer.step()`` does to ``module.state_dict()`` and
``optimizer.state_dict()`` (parameters, buffers such as BatchNorm's running
statistics, momentum buffers, Adam's moments and ``step`` counts), and returns
the loss (detached).  It does not fill ``p.grad``.

**The capture.**  A functional step - ``torch.func.functional_call`` of the
module on parameter/buffer tensors, ``loss_fn`` on its output,
``torch.func.grad_and_value`` for the gradients, and the optimizer written out
per parameter (:mod:`opsched.importers.torch_optim`) - traced by
:mod:`opsched.importers.torch_aten` (``make_fx`` over ``functionalize`` on fake
tensors, so in-place ops and views are explicit dataflow and a data-dependent
branch is an error rather than a frozen guess).  Missing optimizer state is fed
as zeros, so the graph's signature is the same at every step.

**Inputs and outputs** (flat, in this order; :class:`StepLayout` names every one):
inputs are the trainable parameters, frozen parameters (not updated: no grad,
or not in the optimizer), buffers, optimizer state, host scalars (0-d float64:
lr-derived factors, Adam's bias corrections - computed on the host per call so
LR schedulers work), then the leaves of ``x`` and of ``y``; outputs are the
loss, the new trainable parameters, the new buffers (functionalization's
trailing ``copy_`` into the input buffers is dropped: the new values are
outputs instead), then the new optimizer state.  The graph never writes into
its inputs.

**Phases.**  Every op is ``"forward"`` (module and loss), ``"backward"``
(gradients) or ``"update"`` (optimizer), from ``torch.fx.traceback.annotate``
blocks around the three parts; stored as ``graph.meta["phases"]`` (op id ->
phase; see :mod:`opsched.phases` for why meta and not an ``Op`` field).  An
edge never goes from a later phase to an earlier one.

**Parameters that get no gradient** (not used by the loss) are found after a
first trace (their update does not depend on the loss) and traced again as
frozen: torch skips them too (no update, no state).

**Refused** with :class:`~opsched.errors.ModelImportError` (the message names
the op, module or option, and the user's source line where there is one):
optimizers other than SGD/Adam/AdamW, ``differentiable=True``, sparse
gradients (``sparse=True`` embeddings), hooks on the module or its
parameters, data-dependent control flow and host reads of tensor values, ops
that do not trace, a loss that is not a 0-d floating tensor, a step that
writes into a parameter or into ``x``/``y`` in place.  Random ops (dropout)
are kept under the RNG rule of :mod:`opsched.importers.torch_aten`: they run
in eager's order and draw from torch's default generator, so the step gives
eager's numbers after the same ``torch.manual_seed``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils import _pytree as pytree

from opsched.errors import ModelImportError
from opsched.graph import OpGraph
from opsched.importers.torch_aten import (
    AtenSource,
    aten_bookkeeping,
    build_opgraph,
    check_capturable,
    functional_cleanup,
    split_conv_backward,
    trace_functional,
)
from opsched.importers.torch_optim import StepSignatureError, UpdateRule, mark_stepped, same_layout
from opsched.phases import PHASES

__all__ = ["StepLayout", "StepRunner", "StepSignatureError", "StepSource", "capture_step"]

_RANK = {p: i for i, p in enumerate(PHASES)}
_INPUT_ROLES = ("param", "frozen", "buffer", "state", "scalar", "x", "y")
_OUTPUT_ROLES = ("loss", "param", "buffer", "state")


@dataclass(frozen=True)
class StepLayout:
    """What each flat input and output of a captured step is: ``(role, label)``
    pairs.  Input roles: param, frozen, buffer, state, scalar, x, y; output
    roles: loss, param, buffer, state.  Labels are parameter/buffer names,
    ``"name:key"`` for optimizer state and host scalars, the leaf index for x/y."""

    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]

    def input_indices(self, role: str) -> list[int]:
        return [i for i, (r, _) in enumerate(self.inputs) if r == role]

    def output_indices(self, role: str) -> list[int]:
        return [i for i, (r, _) in enumerate(self.outputs) if r == role]

    def to_meta(self) -> dict[str, Any]:
        """JSON-friendly: role -> [[index, label], ...] for inputs and outputs."""
        def side(pairs: Sequence[tuple[str, str]], roles: Sequence[str]) -> dict[str, list]:
            return {r: [[i, lab] for i, (rr, lab) in enumerate(pairs) if rr == r] for r in roles}

        return {"inputs": side(self.inputs, _INPUT_ROLES), "outputs": side(self.outputs, _OUTPUT_ROLES)}


@dataclass(eq=False)
class StepSource(AtenSource):
    """An :class:`AtenSource` that knows it is a training step: its layout, its
    update rule and what it was captured for (checked on every call)."""

    layout: StepLayout | None = field(default=None, repr=False)
    rule: UpdateRule | None = field(default=None, repr=False)
    param_sig: tuple = field(default=(), repr=False)
    buffer_sig: tuple = field(default=(), repr=False)
    modes: tuple[bool, ...] = field(default=(), repr=False)
    x_spec: Any = field(default=None, repr=False)
    y_spec: Any = field(default=None, repr=False)
    leaf_meta: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = field(default=(), repr=False)


# ------------------------------------------------------------------ capture
def _leaves(value: Any, what: str) -> tuple[list[torch.Tensor], Any]:
    leaves, spec = pytree.tree_flatten(value)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
    if bad or not leaves:
        raise ModelImportError(f"capture_step: {what} must be a tensor or a tuple of tensors"
                               + (f" (got a {bad[0]})" if bad else " (got nothing)"))
    return leaves, spec


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    while aten_bookkeeping(out) and isinstance(out.args[0], fx.Node):
        out = out.args[0]
    return out


def _descendants(n: fx.Node) -> set[fx.Node]:
    seen, stack = {n}, [n]
    while stack:
        for u in stack.pop().users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _phases(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Every call node's phase: its annotation, or (none: made by the machinery
    between the annotated blocks) the latest phase among its inputs, else forward."""
    out: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        if not n.op.startswith("call_"):
            continue
        p = n.meta.get("custom", {}).get("phase")
        if p not in _RANK:
            p = max((out[a] for a in n.all_input_nodes if a in out), key=_RANK.__getitem__, default="forward")
        out[n] = p
    return out


def capture_step(module: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: torch.optim.Optimizer,
                 example_x: Any, example_y: Any, name: str | None = None, exact: bool = False) -> OpGraph:
    """Capture one training step of ``module`` as an OpGraph with a :class:`StepSource`.

    ``example_x`` is a tensor or a tuple of tensors (the module's positional
    inputs), ``example_y`` what ``loss_fn(module(*x), y)`` takes as targets.
    Only their shapes and dtypes matter (the capture runs on fake tensors and
    changes nothing: not the module, the optimizer nor the RNG).  See the
    module docstring for the layout, phases and what is refused.

    ``exact=True`` writes the optimizer update op for op as torch does, and
    traces with views kept (autograd then picks eager's stride-dependent backward
    formulas, :mod:`opsched.importers.torch_aten`), so a sequential replay is
    bitwise equal to eager on the CPUs tested (an Intel Xeon, an AMD EPYC); the default saves one pass
    over the parameters and agrees to within one rounding per step
    (:mod:`opsched.importers.torch_optim`).
    """
    if not isinstance(module, nn.Module):
        raise ModelImportError(f"capture_step expects a torch.nn.Module, got {type(module).__name__}")
    if not callable(loss_fn):
        raise ModelImportError(f"capture_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    gname = name or f"{type(module).__name__}-step"
    what = f"a training step of {gname!r}"
    check_capturable(module, what)
    if isinstance(loss_fn, nn.Module):
        check_capturable(loss_fn, what)
    named = dict(module.named_parameters())
    skip: list[str] = []
    for _ in range(2):
        rule = UpdateRule(optimizer, named, skip, exact=exact)
        if not rule.params:
            raise ModelImportError(f"cannot capture {what}: the optimizer updates none of the module's parameters "
                                   "that require grad (nothing to train)")
        gm, layout, flat = _trace_step(module, loss_fn, optimizer, rule, named, example_x, example_y, what)
        unused = _unused(gm, layout)
        if not unused:
            break
        skip += unused
    else:  # pragma: no cover - the second trace has every unused parameter frozen
        raise ModelImportError(f"cannot capture {what}: parameters {unused} get no gradient")
    phase = _phases(gm)
    persistent = {ph.name for ph, (role, _) in zip(_placeholders(gm), layout.inputs)
                  if role in ("param", "frozen", "buffer", "state")}
    x_leaves, x_spec = _leaves(example_x, "example_x")
    y_leaves, y_spec = _leaves(example_y, "example_y")
    meta = {
        "source": "make_fx",
        "mode": "train",
        "module": type(module).__name__,
        "loss": getattr(loss_fn, "__name__", type(loss_fn).__name__),
        "inputs": [list(x.shape) for x in x_leaves],
        "targets": [list(y.shape) for y in y_leaves],
        "step": {**rule.describe(), **layout.to_meta()},
    }
    def one_op_per_param(n: fx.Node) -> str | None:
        tag = n.meta.get("custom", {}).get("param")
        return tag if phase[n] == "update" and tag is not None else None

    order = update_in_place(gm, layout)
    meta["step"]["in_place"] = len(order["chains"])
    cap = build_opgraph(gm, flat, gname, meta, persistent=persistent, phase_of=phase.__getitem__,
                        merge_key=one_op_per_param, order=order["before"])
    base = cap.source
    source = StepSource(
        **{f.name: getattr(base, f.name) for f in fields(AtenSource)},
        layout=layout, rule=rule, param_sig=_param_sig(module), buffer_sig=_buffer_sig(module),
        modes=tuple(m.training for m in module.modules()), x_spec=x_spec, y_spec=y_spec,
        leaf_meta=tuple((f"x[{i}]", tuple(t.shape), t.dtype) for i, t in enumerate(x_leaves))
        + tuple((f"y[{i}]", tuple(t.shape), t.dtype) for i, t in enumerate(y_leaves)),
    )
    return cap.graph.with_source(source)


def _param_sig(module: nn.Module) -> tuple:
    return tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())


def _buffer_sig(module: nn.Module) -> tuple:
    return tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())


def _first_difference(a: tuple, b: tuple) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{y} instead of {x}"
    return f"{len(b)} entries instead of {len(a)}"


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _trace_step(module: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer, rule: UpdateRule,
                named: Mapping[str, nn.Parameter], example_x: Any, example_y: Any, what: str
                ) -> tuple[fx.GraphModule, StepLayout, list]:
    trainable = list(rule.params)
    frozen = [n for n in named if n not in rule.params]
    buffers = dict(module.named_buffers())
    x_leaves, x_spec = _leaves(example_x, "example_x")
    y_leaves, y_spec = _leaves(example_y, "example_y")
    state = rule.state_inputs(optimizer, named)
    scalars = rule.host_scalars(optimizer, named)
    flat = ([named[n].detach() for n in trainable] + [named[n].detach() for n in frozen] + list(buffers.values())
            + state + scalars + x_leaves + y_leaves)
    inputs = ([("param", n) for n in trainable] + [("frozen", n) for n in frozen] + [("buffer", n) for n in buffers]
              + [("state", f"{n}:{k}") for n in trainable for k in rule.params[n].state_keys]
              + [("scalar", f"{n}:{k}") for n in trainable for k in rule.params[n].scalar_keys]
              + [("x", str(i)) for i in range(len(x_leaves))] + [("y", str(i)) for i in range(len(y_leaves))])
    outputs = ([("loss", "loss")] + [("param", n) for n in trainable] + [("buffer", n) for n in buffers]
               + [("state", f"{n}:{k}") for n in trainable for k in rule.params[n].state_keys])
    layout = StepLayout(tuple(inputs), tuple(outputs))

    def step(*args: torch.Tensor) -> list[torch.Tensor]:
        it = iter(args)
        P = {n: next(it) for n in trainable}
        F = {n: next(it) for n in frozen}
        B = {n: next(it) for n in buffers}
        S = {n: tuple(next(it) for _ in rule.params[n].state_keys) for n in trainable}
        K = {n: tuple(next(it) for _ in rule.params[n].scalar_keys) for n in trainable}
        X = pytree.tree_unflatten([next(it) for _ in x_leaves], x_spec)
        Y = pytree.tree_unflatten([next(it) for _ in y_leaves], y_spec)
        xs = X if isinstance(X, tuple) else (X,)

        def loss_of(P: dict, B: dict) -> tuple[torch.Tensor, dict]:
            with fx_traceback.annotate({"phase": "forward"}):
                out = torch.func.functional_call(module, ({**P, **F}, B), xs)
                loss = loss_fn(out, Y)
                if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
                    got = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
                           if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
                    raise ModelImportError(f"cannot capture {what}: loss_fn must return a 0-d floating tensor "
                                           f"(e.g. a mean), got {got}")
            return loss, B

        with fx_traceback.annotate({"phase": "backward"}):  # grads w.r.t. P; value and aux come out detached
            grads, (loss, new_b) = torch.func.grad_and_value(loss_of, has_aux=True)(P, B)
        with fx_traceback.annotate({"phase": "update"}):
            new_p, new_s = rule.update(P, grads, S, K)
        return ([loss] + [new_p[n] for n in trainable] + [new_b[n] for n in buffers]
                + [t for n in trainable for t in new_s[n]])

    gm = trace_functional(step, flat, what, keep_views=rule.exact)
    mutated = functional_cleanup(gm, what)
    placeholders = _placeholders(gm)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    buffer_out = {lab: i for i, (role, lab) in enumerate(outputs) if role == "buffer"}
    for ph, (role, label) in zip(placeholders, inputs):
        if ph.name not in mutated:
            continue
        if role != "buffer":
            kind = {"param": "parameter", "frozen": "parameter", "x": "input x", "y": "target y"}.get(role, role)
            raise ModelImportError(f"cannot capture {what}: the step writes into {kind} {label!r} in place; "
                                   "only buffers may be updated by the forward")
        outs[buffer_out[label]] = mutated[ph.name]  # the buffer's new value is an output
    out_node.args = (outs,)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    split_conv_backward(gm)
    return gm, layout, flat


def _in_place_overload(target: Any) -> Any:
    """The in-place overload of an aten op (``aten.add.Tensor`` -> ``aten.add_.Tensor``), or None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    base = getattr(torch.ops.aten, target._schema.name.split("::")[-1] + "_", None)
    return getattr(base, target._overloadname, None) if base is not None else None


def update_in_place(gm: fx.GraphModule, layout: StepLayout) -> dict[str, Any]:
    """Let the update write the new parameters, optimizer state and buffers into the old ones.

    Why: the functional step computes each new value into fresh memory
    (``new_p = p - lr * buf``), a write to cold, just-allocated pages of the
    size of the whole model per step, where eager's ``optimizer.step()``
    updates in place (measured on randwire, batch 4: the update phase 14 ms
    against eager's 9).  So where a new value is a chain of elementwise ops
    whose first argument is, step by step, the old value - ``add(mul(buf, mu),
    g)`` - and nothing else in the chain reads it, the chain's ops become their
    in-place overloads (``mul_``, ``add_``) writing into the input tensor, and
    every *other* reader of the old value (a backward op reading a weight) is
    ordered before the chain's first write (returned as ``before`` pairs, which
    become zero-byte edges).  The graph then writes into its parameter, state
    and buffer inputs - as eager's update does - and the step's outputs are
    those input tensors themselves (:meth:`StepRunner.write_back` has nothing
    to store).  Returns ``{"chains": [...], "before": [(reader, first write), ...]}``."""
    placeholders = _placeholders(gm)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    by_label = {(r, lab): ph for ph, (r, lab) in zip(placeholders, layout.inputs)}
    chains: list[list[fx.Node]] = []
    before: list[tuple[fx.Node, fx.Node]] = []
    output_users = {id(o) for o in outs}
    for i, (role, label) in enumerate(layout.outputs):
        if role not in ("param", "state", "buffer"):
            continue
        ph = by_label.get((role if role != "state" else "state", label))
        v = outs[i]
        if ph is None or not isinstance(v, fx.Node) or v is ph:
            continue
        want = ph.meta.get("val")
        chain: list[fx.Node] = []
        n = v
        ok = True
        while n is not ph:
            got = n.meta.get("val")
            if (n.op != "call_function" or _in_place_overload(n.target) is None or not n.args
                    or not isinstance(n.args[0], fx.Node) or want is None or not isinstance(got, torch.Tensor)
                    or got.shape != want.shape or got.dtype != want.dtype or got.stride() != want.stride()):
                ok = False
                break
            if n is not v and len(n.users) != 1:  # an intermediate read elsewhere must keep its value
                ok = False
                break
            if any(a is ph or a in chain for a in n.all_input_nodes[1:] if isinstance(a, fx.Node)) \
                    or any(isinstance(a, fx.Node) and (a is ph or a in chain) for a in n.kwargs.values()):
                ok = False
                break
            chain.append(n)
            n = n.args[0]
        if not ok or not chain or sum(1 for o in outs if o is v) != 1 or id(ph) in output_users:
            continue
        first = chain[-1]
        others = _readers(ph, first)
        if any(u in chain for u in others):
            continue
        for n in chain:
            n.target = _in_place_overload(n.target)
        chains.append(chain)
        before += [(u, first) for u in others if u.op != "output"]
    if chains:
        gm.recompile()
    return {"chains": chains, "before": before}


def _readers(ph: fx.Node, first: fx.Node) -> list[fx.Node]:
    """Every node but ``first`` that reads ``ph`` directly or through views of it (a transposed
    weight read by a matmul reads the weight): those must run before ``first`` writes into it."""
    out: list[fx.Node] = []
    stack = [u for u in ph.users if u is not first]
    seen: set[fx.Node] = set()
    while stack:
        u = stack.pop()
        if u in seen or u.op == "output":
            continue
        seen.add(u)
        out.append(u)
        if aten_bookkeeping(u):
            stack.extend(u.users)
    return out


def _unused(gm: fx.GraphModule, layout: StepLayout) -> list[str]:
    """Trainable parameters whose new value does not depend on the loss."""
    reach = _descendants(_loss_node(gm))
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [layout.outputs[i][1] for i in layout.output_indices("param")
            if not (isinstance(outs[i], fx.Node) and outs[i] in reach)]


# ------------------------------------------------------------------ running
class StepRunner:
    """A captured step bound to a live ``module`` and ``optimizer``: the ones it was
    captured from, or any with the same structure (parameter and buffer names,
    shapes, dtypes, ``requires_grad``; the same optimizer class and param-group
    options over the same parameter names) - a deep copy, say, to check a step
    against eager from the same state.

    ``runner(x, y)`` builds the graph inputs from the module's current
    parameters and buffers, the optimizer's state and param groups (``lr`` read
    every call) and ``x``, ``y``; runs them with ``execute(inputs) -> outputs``
    (default: the sequential replay ``graph.source.run_node_by_node``; pass
    ``lambda inputs: backend.execute(graph, plan, inputs)`` to run a plan);
    writes the new parameters, buffers and optimizer state back; returns the loss.

    Write-back: with ``write="swap"`` (the default) each new tensor takes the
    old one's place - ``p.data = new`` for parameters and buffers (the same
    ``Parameter`` objects, so the module, the optimizer and the user's
    references to ``p`` see the new values), a new entry in
    ``optimizer.state`` - which costs nothing; eager's in-place update costs
    nothing either, and a ``copy_`` per tensor was measured at ~15% of an
    inception step.  What it does not keep is an alias taken *of the data*
    (``v = p.detach()``, a view of a parameter, a state tensor held
    elsewhere): those keep the old values.  ``write="copy"`` ``copy_``s into
    the existing tensors instead, exactly as ``optimizer.step()`` updates
    them.  Tensors of another layout (strides, a view into a shared buffer)
    are always copied.

    Every call first checks that the call matches the capture - shapes and
    dtypes of ``x`` and ``y``, the module's parameters and train/eval modes, no
    hooks added, the optimizer's param groups (only ``lr`` may change) - and
    raises :class:`StepSignatureError` (a ``ModelImportError``) when it does not.
    """

    def __init__(self, graph: OpGraph, module: nn.Module, optimizer: torch.optim.Optimizer,
                 write: str = "swap") -> None:
        if write not in ("swap", "copy"):
            raise ValueError(f"StepRunner: write must be 'swap' or 'copy', got {write!r}")
        self.write = write
        src = graph.source
        if not isinstance(src, StepSource) or src.layout is None or src.rule is None:
            raise ModelImportError(f"graph {graph.name!r} is not a captured training step (no StepSource); "
                                   "capture it with opsched.importers.torch_step.capture_step")
        self.graph = graph
        self.source: StepSource = src
        #: The source's layout and update rule (never None on a captured step: checked above).
        self.layout: StepLayout = src.layout
        self.rule: UpdateRule = src.rule
        self.module = module
        self.optimizer = optimizer
        for what, sig, captured in (("parameters", _param_sig(module), src.param_sig),
                                    ("buffers", _buffer_sig(module), src.buffer_sig)):
            if sig != captured:
                raise StepSignatureError(f"graph {graph.name!r} was captured from a module with other {what} "
                                         f"({_first_difference(captured, sig)}); capture this module's step")
        self.params = dict(module.named_parameters())
        self._name_of = {id(p): n for n, p in self.params.items()}
        self._param_ids = tuple(id(p) for p in self.params.values())
        self.buffers = dict(module.named_buffers())
        src.rule.check_unchanged(optimizer, self._name_of)
        lay = src.layout
        self._param_in = [self.params[lab] for r, lab in lay.inputs if r in ("param", "frozen")]
        self._param_out = [(i, self.params[lay.outputs[i][1]]) for i in lay.output_indices("param")]
        self._buffer_out = [(i, lay.outputs[i][1]) for i in lay.output_indices("buffer")]
        self._state_out = lay.output_indices("state")

    # ------------------------------------------------------------ checks
    def check(self, x: Any, y: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Raise :class:`StepSignatureError` unless a call with ``x``, ``y`` matches
        the capture; return their tensor leaves."""
        src = self.source
        name = self.graph.name
        xs, x_spec = pytree.tree_flatten(x)
        ys, y_spec = pytree.tree_flatten(y)
        if x_spec != src.x_spec or y_spec != src.y_spec:
            raise StepSignatureError(f"step {name!r}: x / y have another structure than at capture "
                                     f"({x_spec} / {y_spec}, captured {src.x_spec} / {src.y_spec})")
        for t, (label, shape, dtype) in zip(xs + ys, src.leaf_meta):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise StepSignatureError(f"step {name!r}: {label} is {got}, the step was captured for "
                                         f"{shape} {dtype}; re-capture for this shape")
        modules = list(self.module.modules())
        if tuple(m.training for m in modules) != src.modes:
            raise StepSignatureError(f"step {name!r}: the module's train/eval modes changed since capture "
                                     "(module.train() / .eval()); re-capture the step")
        if tuple(id(p) for p in self.module.parameters()) != self._param_ids:
            raise StepSignatureError(f"step {name!r}: the module's parameters were replaced since the runner was "
                                     "made; make a new StepRunner (or re-capture)")
        for m in modules:
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                check_capturable(self.module, f"step {name!r}")  # raises, naming the hook
        self.rule.check_unchanged(self.optimizer, self._name_of)
        return xs, ys

    # ------------------------------------------------------------ one step
    def inputs(self, x: Any, y: Any) -> tuple:
        """The flat graph inputs of one step on ``x``, ``y`` (after :meth:`check`)."""
        xs, ys = self.check(x, y)
        rule = self.rule
        return tuple([p.detach() for p in self._param_in] + list(self.buffers.values())
                     + rule.state_inputs(self.optimizer, self.params) + rule.host_scalars(self.optimizer, self.params)
                     + xs + ys)

    def write_back(self, outputs: Sequence[torch.Tensor], inputs: Sequence[Any]) -> torch.Tensor:
        """Store a step's ``outputs`` into the module and optimizer; return the loss."""
        lay = self.layout
        if len(outputs) != len(lay.outputs):
            raise ModelImportError(f"step {self.graph.name!r}: expected {len(lay.outputs)} outputs, "
                                   f"got {len(outputs)}")
        owned = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        input_ids = {id(t) for t in inputs}
        seen: set[int] = set()
        fresh: set[int] = set()
        outs = list(outputs)
        for i, t in enumerate(outs):
            if i == 0 or not isinstance(t, torch.Tensor):
                continue
            if id(t) in input_ids:
                continue  # unchanged (a buffer the step does not update)
            if t.untyped_storage().data_ptr() in owned or id(t) in seen:
                outs[i] = t = t.clone()  # an alias of live state: read it before anything is overwritten
            seen.add(id(t))
            fresh.add(id(t))
        swap = self.write == "swap"
        with torch.no_grad():
            for i, t in [(i, p) for i, p in self._param_out] + [(i, self.buffers[b]) for i, b in self._buffer_out]:
                new = outs[i]
                if new is t:
                    continue
                if swap and id(new) in fresh and same_layout(t, new):
                    t.data = new  # the same Parameter / buffer object, now over the new values
                    fresh.discard(id(new))
                else:
                    t.copy_(new)
            rule = self.rule
            new_state: dict[str, list[torch.Tensor]] = {n: [] for n in rule.params}
            it = iter(self._state_out)
            for n, r in rule.params.items():
                for _ in r.state_keys:
                    new_state[n].append(outs[next(it)])
            rule.write_state(self.optimizer, self.params, new_state, fresh, swap=swap)
        mark_stepped(self.optimizer)
        return outs[0]

    def __call__(self, x: Any, y: Any, execute: Callable[[tuple], Sequence[torch.Tensor]] | None = None
                 ) -> torch.Tensor:
        inputs = self.inputs(x, y)
        outputs = execute(inputs) if execute is not None else self.source.run_node_by_node(*inputs)
        return self.write_back(outputs, inputs)
