"""Keras training steps on TensorFlow's graph runtime (``tf``): the apply pipeline's training mode for Keras.

The network is a :class:`KerasTrainingNetwork` (the user's Keras model, loss
and Keras optimizer); the import is
:func:`opsched.importers.tf_step.capture_keras_step` (forward, backward and the
optimizer's update as one graph whose variables stay resources, phases per
op); the backend runs the step in the TensorFlow worker of the plan's
``(inter, intra)`` setting under the plan's control dependencies and devices
(:mod:`opsched.backends.tf_train`); the check compares one scheduled step with
one step of Keras's own ``tf.function`` from the same state (the user's model
is put back afterwards) - or, when they differ, with one eager step
(:meth:`KerasTrainAdapter.eager_reference`: Keras's two executions of a step
disagree by far more than the check's tolerance on untrained application
models).

What the user gets is a :class:`KerasTrainStep`: ``loss = step(x, y)`` does
what one batch of ``model.fit`` does - forward in training mode, the loss plus
the model's regularization losses, the gradients, ``optimizer.apply_gradients``
- and ``step.fit(x, y, epochs=..., batch_size=...)`` loops it over a data set
and returns a ``keras.callbacks.History``.  A call with other shapes or dtypes
runs Keras's own step (the same ``tf.function``, in this process) with a
:class:`ScheduleFallbackWarning` saying why.

**Where the weights are (the sync rule).**  The step trains a copy of the
model's variables (weights, BatchNorm statistics, Dropout's seed, the
optimizer's slots and ``iterations``) that lives in the worker process:

* they are shipped to the worker once, at the first scheduled call (and again
  after a call ran in this process);
* they are copied back into the user's model and optimizer by
  :meth:`KerasTrainStep.sync`, at the end of :meth:`KerasTrainStep.fit`,
  before a call that runs in this process (a fallback), and every
  ``sync_every`` scheduled calls when that is set (0, the default: never by
  itself) - so *call ``step.sync()`` before reading the model's weights*
  (``step.model`` does it for you);
* small read-only variables (the learning rate) are re-sent whenever they
  change in this process, so ``optimizer.learning_rate = ...`` between calls
  works; after changing weights yourself (``set_weights``, ``model.fit``),
  call :meth:`KerasTrainStep.push`.

A copy costs about a memory copy of the state per process boundary (the
figures are in ``sync_stats`` and the benchmark's JSON): cheap for one
``sync`` after many steps, too dear to do after every step by default.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opsched.adapters.base import Adapter, Config, Fallback, FallbackReason, Scheduled
from opsched.errors import ExecutionError, OpschedError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.specs import KerasTrainingNetwork, keras_application_step, make_keras_optimizer  # noqa: F401

if TYPE_CHECKING:
    from opsched.engine.contracts import Backend, PerfModel
    from opsched.importers.tf_step import KerasStepCapture
    from opsched.policies.base import Policy

#: The check of one scheduled step against Keras's: loss and model variables elementwise;
#: optimizer slots relative to each tensor's largest entry (Adam's second moments are ~1e-9
#: and move with float32 round-off).
STEP_RTOL, STEP_ATOL, STATE_REL = 1e-4, 1e-5, 1e-3
#: Read-only variables at most this large are re-sent to the worker whenever they change here.
SMALL_BYTES = 64
#: Name prefix of the measured choice's candidates that leave the order to TensorFlow.
TF_ORDER = "tf-order"


def _leaves(x: Any, y: Any) -> tuple[np.ndarray, ...]:
    from opsched.importers.tf_step import as_leaves

    return (*as_leaves(x, "x"), *as_leaves(y, "y"))


def _compare(cap: KerasStepCapture, got: Sequence[np.ndarray], want: Sequence[np.ndarray], loss: float,
             want_loss: float) -> str | None:
    """Why the state after a scheduled step differs from the state after Keras's step, or None."""
    from opsched.importers.tf_step import OPTIMIZER

    if not np.isclose(loss, want_loss, rtol=STEP_RTOL, atol=STEP_ATOL):
        return f"the loss {loss:.6g} differs from Keras's {want_loss:.6g}"
    for var, a, b in zip(cap.source.variables, got, want):
        if a.shape != b.shape:
            return f"{var.name} has shape {a.shape} after the step, Keras's {b.shape}"
        if not np.issubdtype(b.dtype, np.floating):
            if not np.array_equal(a, b):
                return f"{var.name} after one step differs from Keras's"
            continue
        atol = STEP_ATOL + (STATE_REL * float(np.max(np.abs(b))) if var.role == OPTIMIZER and b.size else 0.0)
        if not np.allclose(a, b, rtol=STEP_RTOL, atol=atol):
            return f"{var.name} after one step differs from Keras's"
    return None


def _drop_state(backend: Any, graph: OpGraph, settings: Any, state: str) -> None:
    from opsched.backends.tf_train import drop

    try:
        drop(backend, graph, settings, state)
    except Exception:  # noqa: BLE001 - best effort: the worker may be gone already
        pass


class KerasTrainStep(Scheduled):
    """A scheduled Keras training step: ``loss = step(x, y)``, ``step.fit(x, y, ...)``, ``step.sync()``
    (see the module docstring for where the weights are between calls)."""

    def __init__(self, network: KerasTrainingNetwork, capture: KerasStepCapture | None, example: tuple, *,
                 graph: OpGraph | None, plan: Plan | None, machine: Machine, policy: Policy | None,
                 backend: Backend | None, fallback: Fallback | None, sync_every: int = 0) -> None:
        self.network = network
        self.capture = capture if fallback is None else None
        self.sync_every = int(sync_every)
        self.state = f"keras-{uuid.uuid4().hex[:12]}"
        self._where = "main"  # where the newest values are: main | worker | both
        self._calls = 0
        self._pushed_small: dict[int, np.ndarray] = {}
        self.sync_stats = {"pushes": 0, "push_s": 0.0, "pulls": 0, "pull_s": 0.0, "pull_bytes": 0}
        self._settings: Any = None
        self._hold(example, graph, plan, machine, policy, backend, fallback)
        if self.fallback is None and self.capture is not None:
            assert backend is not None and graph is not None and plan is not None
            from opsched.backends.tf_train import plan_args

            self._settings = plan_args(backend, graph, plan).settings
            src = self.capture.source
            self._written = [i for i, v in enumerate(src.variables) if v.written]
            self._small = [i for i, v in enumerate(src.variables) if not v.written and v.nbytes <= SMALL_BYTES]
            self._finalizer = weakref.finalize(self, _drop_state, backend, graph, self._settings, self.state)

    # -------------------------------------------------------------- views
    @property
    def model(self) -> Any:
        """The user's Keras model, holding the trained weights (synced first)."""
        self.sync()
        return self.network.model

    @property
    def optimizer(self) -> Any:
        """The user's Keras optimizer, holding the trained slots (synced first)."""
        self.sync()
        return self.network.optimizer

    # --------------------------------------------------------------- sync
    def push(self) -> None:
        """Ship the model's and optimizer's current values to the worker (after you changed them yourself)."""
        if self.capture is None:
            return
        from opsched.backends.tf_train import push

        assert self.graph is not None  # a scheduled step (capture set) has its graph
        t0 = time.perf_counter()
        values = self.capture.read()
        push(self.backend, self.graph, self._settings, self.state, values)
        self._pushed_small = {i: np.array(values[i]) for i in self._small}
        self._where = "both"
        self.sync_stats["pushes"] += 1
        self.sync_stats["push_s"] += time.perf_counter() - t0

    def sync(self) -> float:
        """Copy the trained values from the worker into the user's model and optimizer (a no-op when
        they are there already); returns the seconds it took."""
        if self.capture is None or self._where != "worker":
            return 0.0
        from opsched.backends.tf_train import pull

        assert self.graph is not None  # a scheduled step (capture set) has its graph
        t0 = time.perf_counter()
        values = pull(self.backend, self.graph, self._settings, self.state, self._written)
        self.capture.write(values, self._written)
        self._where = "both"
        dt = time.perf_counter() - t0
        self.sync_stats["pulls"] += 1
        self.sync_stats["pull_s"] += dt
        self.sync_stats["pull_bytes"] += int(sum(v.nbytes for v in values))
        return dt

    def _push_small(self) -> None:
        """Re-send the small read-only variables (the learning rate) that changed here."""
        if not self._small or self.capture is None:
            return
        from opsched.backends.tf_train import push

        assert self.graph is not None  # a scheduled step (capture set) has its graph
        now = self.capture.read(self._small)
        changed = [k for k, i in enumerate(self._small)
                   if i not in self._pushed_small or not np.array_equal(now[k], self._pushed_small[i])]
        if changed:
            which = [self._small[k] for k in changed]
            push(self.backend, self.graph, self._settings, self.state, [now[k] for k in changed], which)
            for k, i in zip(changed, which):
                self._pushed_small[i] = np.array(now[k])

    # --------------------------------------------------------------- call
    def eager(self, x: Any, y: Any) -> np.float32:
        """Keras's own step in this process (the worker's newest values copied back first)."""
        self.sync()
        loss = self.network.function()(*_leaves(x, y))
        self._where = "main"
        return np.float32(np.asarray(loss))

    def __call__(self, x: Any, y: Any) -> np.float32:
        leaves = _leaves(x, y)
        why = self.fallback or self._why_inputs(leaves)
        if why is not None:
            if why is not self.fallback:
                self._warn_once(why, "the Keras training step")
            return self.eager(x, y)
        from opsched.backends.tf_train import step

        assert self.backend is not None and self.graph is not None and self.plan is not None
        try:
            if self._where == "main":
                self.push()
            else:
                self._push_small()
            loss = step(self.backend, self.graph, self.plan, self.state, leaves)
        except ExecutionError as exc:
            if self._where == "worker":
                raise ExecutionError(f"the scheduled Keras training step failed and the worker's state since "
                                     f"the last sync is lost (the model holds the values of the last sync): "
                                     f"{exc}") from exc
            self.fallback = Fallback(FallbackReason.RUN_FAILED, f"the scheduled step failed: {exc}")
            self._warn_once(self.fallback, "the Keras training step")
            return self.eager(x, y)
        self._where = "worker"
        self._calls += 1
        if self.sync_every > 0 and self._calls % self.sync_every == 0:
            self.sync()
        return np.float32(loss)

    def fit(self, x: Any, y: Any, *, epochs: int = 1, batch_size: int | None = None, shuffle: bool = True,
            seed: int | None = None, verbose: int = 0) -> Any:
        """``model.fit`` for numpy data: ``epochs`` passes over ``(x, y)`` in batches of ``batch_size``
        (default: the captured batch), shuffled each epoch unless ``shuffle=False`` (numpy's RNG seeded
        with ``seed``, not Keras's: equal to ``model.fit`` with ``shuffle=False``).  A last, smaller batch
        runs Keras's own step (another shape).  Returns a ``keras.callbacks.History`` whose ``history["loss"]``
        is each epoch's mean loss weighted by batch size, as ``model.fit`` reports it; syncs at the end."""
        import keras

        xs = _leaves(x, y)
        xs, ys = xs[:-1], xs[-1]
        n = int(ys.shape[0])
        if any(int(a.shape[0]) != n for a in xs):
            raise OpschedError(f"fit: x and y have different numbers of samples "
                               f"({[int(a.shape[0]) for a in xs]} and {n})")
        bs = int(batch_size or self.example_inputs[0].shape[0])
        if epochs < 1 or bs < 1:
            raise OpschedError(f"fit: epochs and batch_size must be >= 1, got {epochs} and {bs}")
        rng = np.random.default_rng(seed)
        history: dict[str, list[float]] = {"loss": []}
        for epoch in range(epochs):
            order = rng.permutation(n) if shuffle else np.arange(n)
            total, count = 0.0, 0
            for start in range(0, n, bs):
                idx = order[start:start + bs]
                bx = tuple(a[idx] for a in xs)
                first, *rest = bx  # a model has at least one input
                loss = self(bx if rest else first, ys[idx])
                total += float(loss) * len(idx)
                count += len(idx)
            history["loss"].append(total / max(count, 1))
            if verbose:
                print(f"Epoch {epoch + 1}/{epochs} - loss: {history['loss'][-1]:.4f}")
        self.sync()
        out = keras.callbacks.History()
        out.history, out.epoch = history, list(range(epochs))
        out.params = {"epochs": epochs, "steps": -(-n // bs), "verbose": verbose}
        return out

    def close(self) -> None:
        """Sync, then free the worker's copy of the state."""
        self.sync()
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        self._where = "main"

    def __repr__(self) -> str:
        return f"KerasTrainStep({self._repr()})"


class KerasTrainAdapter(Adapter):
    """A :class:`KerasTrainingNetwork` on the TensorFlow runtime (``tf``)."""

    framework = "keras-train"
    tolerance = (STEP_RTOL, STEP_ATOL)

    def __init__(self, network: Any, inputs: Any, backend: str, batch: int = 1) -> None:
        if not (isinstance(inputs, (tuple, list)) and len(inputs) == 2):
            raise TypeError("opsched.train_step: example inputs are (example_x, example_y)")
        leaves = _leaves(*inputs)
        super().__init__(network, leaves, backend, int(leaves[0].shape[0]) if leaves[0].ndim else batch)
        self.capture: KerasStepCapture | None = None
        self._reference: Any = None
        self._eager_reference: Any = None

    @property
    def label(self) -> str:
        return f"{getattr(self.network.model, 'name', type(self.network.model).__name__)} training step"

    def import_graph(self) -> OpGraph:
        from opsched.importers.tf_step import capture_keras_step

        net = self.network
        *xs, y = self.inputs
        self.capture = capture_keras_step(net.model, net.loss, net.optimizer, tuple(xs), y,
                                          name=getattr(net.model, "name", None))
        net._function = self.capture.function  # one tf.function for the check, the fallback and the user
        return self.capture.graph

    def feeds(self, graph: OpGraph) -> tuple:
        return self.inputs

    def reference(self, graph: OpGraph, feeds: tuple) -> Any:
        """One step of Keras's own ``tf.function`` from the model's current state: (values after it,
        loss); the model and optimizer are put back as they were."""
        if self._reference is None:
            cap = self._cap()
            before = cap.read()
            try:
                loss = float(np.asarray(cap.function(*feeds)))
                after = cap.read()
            finally:
                cap.write(before)
            self._reference = (after, loss)
        return self._reference

    def eager_reference(self) -> tuple[list[np.ndarray], float]:
        """One eager step (the same Python step, no tf.function) from the model's current state: (values
        after it, loss); the model and optimizer are put back.  Keras's two executions of one step
        disagree on an untrained application model (BatchNorm over batch 4, 1000 classes: the first
        layers' first update moves by ~1e-3 between them, 50-100x the check's tolerance), so a step
        that equals either one is Keras's step."""
        if self._eager_reference is None:
            from opsched.importers.tf_step import make_step, resolve_loss

            cap, net = self._cap(), self.network
            fn = make_step(net.model, resolve_loss(net.loss), net.optimizer)
            before = cap.read()
            try:
                loss = float(np.asarray(fn(*self.inputs)))
                after = cap.read()
            finally:
                cap.write(before)
            self._eager_reference = (after, loss)
        return self._eager_reference

    def _cap(self) -> KerasStepCapture:
        if self.capture is None:
            raise OpschedError("the Keras training step was not captured")
        return self.capture

    def _check(self, backend: Any, graph: OpGraph, settings: Any, placement: dict, after: dict,
               feeds: tuple) -> str | None:
        """One step from the model's current state at ``settings`` (on a state of its own), compared
        with :meth:`reference`."""
        from opsched.backends import tf_train

        cap = self._cap()
        want, want_loss = self.reference(graph, feeds)
        state = f"check-{uuid.uuid4().hex[:12]}"
        tf_train.push(backend, graph, settings, state, cap.read())
        try:
            reply, _ = tf_train.call(backend, graph, settings, list(feeds), placement, after, state=state)
            got = tf_train.pull(backend, graph, settings, state)
        finally:
            tf_train.drop(backend, graph, settings, state)
        loss = float(reply["losses"][-1])
        why = _compare(cap, got, want, loss, want_loss)
        if why is None:
            return None
        eager, eager_loss = self.eager_reference()
        if _compare(cap, got, eager, loss, eager_loss) is None:
            return None
        return f"{why} (and from the eager step's)"

    def check_run(self, backend: Backend, graph: OpGraph, plan: Plan, feeds: tuple, reference: Any) -> str | None:
        tf_backend: Any = backend
        settings, placement, after = tf_backend._plan_args(graph, plan)
        return self._check(backend, graph, settings, placement, after, feeds)

    def choose(self, graph: OpGraph, plan: Plan, found: dict[str, tuple[Plan, float]] | None, machine: Machine,
               model: PerfModel, policy: Policy | None) -> tuple[Plan, dict[str, tuple[Plan, float]] | None]:
        """The policy's plan, plus TensorFlow's own order at every ``(inter, intra)`` pair of thread
        levels as candidates that are always timed (co-running ops with one thread each is what pays
        in training on few cores, and TensorFlow's order may beat a plan's control dependencies)."""
        from opsched.engine.sim import Simulator

        sim = Simulator(machine, model=model)
        out = dict(found) if found else {"model": (plan, sim.makespan(graph, plan))}
        names = []
        for name, cand in tf_order_plans(graph, machine).items():
            out[name] = (cand, sim.makespan(graph, cand))
            names.append(name)
        self.always_time = ("heuristic:sequential", *names)
        return plan, out

    def eager_description(self) -> str:
        return f"{self.label} (Keras's own tf.function)"

    def wrap(self, graph: OpGraph | None, plan: Plan | None, machine: Machine, policy: Policy | None,
             backend: Backend | None, fallback: Fallback | None, feeds: tuple, reference: Any = None) -> Scheduled:
        return KerasTrainStep(self.network, self.capture, self.inputs, graph=graph, plan=plan, machine=machine,
                              policy=policy, backend=backend, fallback=fallback)

    def configs(self, graph: OpGraph, feeds: tuple, backend: Backend, machine: Machine) -> dict[str, Config]:
        """TensorFlow's default and recommended settings for the same step (TensorFlow's order, each in
        its own worker), timed on a scratch state, each checked once against Keras's step."""
        from opsched.backends.tf_cpu import tf_default, tf_recommended

        tf_backend: Any = backend
        out = {}
        for name, st in (("tf-default", tf_default()), ("tf-recommended", tf_recommended(machine))):
            desc = f"{'TF picks: ' if st.inter == st.intra == 0 else ''}inter={st.inter}, intra={st.intra}"
            same = self._check(backend, graph, st, {}, {}, feeds) is None
            out[name] = Config(lambda st=st: float(tf_backend.measure(graph, st, repeats=1, warmup=0,
                                                                       inputs=list(feeds))[0]), desc, same)
        return out

    def timer(self, scheduled: Scheduled, feeds: tuple) -> Callable[[], float]:
        """One step on the worker's scratch state, timed inside the worker (the user's model is not
        trained by timing); for a step that fell back, Keras's own step, the model put back after."""
        if isinstance(scheduled, KerasTrainStep) and scheduled.fallback is None:
            tf_backend: Any = scheduled.backend
            graph, plan = scheduled.graph, scheduled.plan
            return lambda: float(tf_backend.time_plan(graph, plan, repeats=1, warmup=0, inputs=list(feeds))[0])
        fn = self.network.function()
        cap = self.capture

        def once() -> float:
            before = cap.read() if cap is not None else None
            t0 = time.perf_counter()
            fn(*feeds)
            dt = time.perf_counter() - t0
            if cap is not None and before is not None:
                cap.write(before)
            return dt

        return once

    def note(self) -> str | None:
        return ("train: '= eager' compares one scheduled step with one step of Keras's own tf.function from the "
                "same state (loss, every variable and optimizer slot); rows time steps on the worker's scratch "
                "state, inside the worker")


def tf_order_plans(graph: OpGraph, machine: Machine) -> dict[str, Plan]:
    """``tf-order:inter=I,intra=J`` -> a plan that runs the step in TensorFlow's own order with pools of
    I and J threads, for every pair of the CPU's thread levels."""
    from opsched.plan import Assignment, uniform_plan

    levels = machine.cpu.thread_levels()
    n = len(graph.ops)
    out = {}
    for inter in levels:
        for intra in levels:
            name = f"{TF_ORDER}:inter={inter},intra={intra}"
            base = uniform_plan(graph, machine, intra, policy=name)
            # TensorFlow ignores priorities here; an offset per inter tells the candidates apart
            # (a shortlist keeps one plan per distinct set of assignments)
            shifted = {k: Assignment(a.device, a.threads, a.priority + inter * (n + 1), a.after)
                       for k, a in base.assignments.items()}
            out[name] = Plan(shifted, base.graph_fingerprint, base.machine_fingerprint, name,
                             {**dict(base.meta), "inter_op": inter, "intra_op": intra, "tf_order": True})
    return out




__all__ = ["STEP_ATOL", "STEP_RTOL", "TF_ORDER", "KerasTrainAdapter", "KerasTrainStep", "KerasTrainingNetwork",
           "keras_application_step", "make_keras_optimizer", "tf_order_plans"]
