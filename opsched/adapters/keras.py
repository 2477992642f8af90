"""Keras models on TensorFlow's graph runtime (``tf``): the adapter and the scheduled model.

The model is imported as a frozen GraphDef (:func:`opsched.importers.tf_graph.from_keras`);
the scheduled outputs must equal eager Keras, ``model(x, training=False)``,
within :data:`TF_RTOL` / :data:`TF_ATOL` (Grappler's remapper fuses ops and
oneDNN picks other kernels, so the graph runtime sums in another order:
float32 round-off, not errors).  The framework's own configurations are
TensorFlow's default thread settings and the recommended ones (intra-op =
physical cores per socket, inter-op = sockets), each run in its own worker.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opsched.adapters.base import Adapter, Config, Fallback, Scheduled, outputs_equal
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan

if TYPE_CHECKING:
    from opsched.engine.contracts import Backend
    from opsched.policies.base import Policy

TF_RTOL, TF_ATOL = 1e-3, 1e-5


def keras_eager(model: Any, feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
    """A Keras model called eagerly, its outputs flattened as the importer fetches them."""
    import tensorflow as tf

    out = model(feeds[0] if len(feeds) == 1 else list(feeds), training=False)
    return [np.asarray(t) for t in tf.nest.flatten(out)]


class ScheduledKeras(Scheduled):
    """A Keras model whose calls run a Plan on the TensorFlow runtime
    (:mod:`opsched.backends.tf_cpu`); called with numpy arrays (one per model
    input), it returns the model's outputs as a list of numpy arrays (flattened
    as ``tf.nest.flatten`` orders them)."""

    def __init__(self, model: Any, example_inputs: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Backend | None, fallback: Fallback | None) -> None:
        self.model = model
        self._hold(example_inputs, graph, plan, machine, policy, backend, fallback)

    def eager(self, *feeds: np.ndarray) -> list[np.ndarray]:
        """The Keras model called eagerly (``training=False``), outputs flattened."""
        return keras_eager(self.model, feeds)

    def __call__(self, *feeds: np.ndarray) -> list[np.ndarray]:
        why = self.fallback or self._why_inputs(feeds)
        if why is not None:
            if why is not self.fallback:
                self._warn_once(why, type(self.model).__name__)
            return self.eager(*feeds)
        assert self.backend is not None and self.graph is not None and self.plan is not None
        return self.backend.execute(self.graph, self.plan, list(feeds))

    def time_call(self, *feeds: np.ndarray) -> float:
        """Seconds of one inference, timed inside the TensorFlow worker around the
        session call (no inter-process transfer counted), or eagerly on fallback."""
        if self.fallback is not None or self._why_inputs(feeds) is not None:
            t0 = time.perf_counter()
            self(*feeds)
            return time.perf_counter() - t0
        backend: Any = self.backend
        return float(backend.time_plan(self.graph, self.plan, repeats=1, warmup=0, inputs=list(feeds))[0])

    def __repr__(self) -> str:
        return f"ScheduledKeras({self._repr()})"


class KerasAdapter(Adapter):
    """A built Keras model on the TensorFlow runtime."""

    framework = "keras"
    tolerance = (TF_RTOL, TF_ATOL)

    def __init__(self, network: Any, inputs: Any, backend: str, batch: int = 1) -> None:
        given: tuple = () if inputs is None else (
            tuple(np.asarray(a) for a in inputs) if isinstance(inputs, (list, tuple)) else (np.asarray(inputs),))
        super().__init__(network, given, backend, int(given[0].shape[0]) if given else batch)

    def import_graph(self) -> OpGraph:
        from opsched.importers.tf_graph import from_keras

        return from_keras(self.network, batch=self.batch, name=self.label)

    def feeds(self, graph: OpGraph) -> tuple:
        return self.inputs if self.inputs else tuple(graph.source.random_inputs(0))

    def reference(self, graph: OpGraph, feeds: tuple) -> Any:
        return keras_eager(self.network, feeds)

    def wrap(self, graph: OpGraph | None, plan: Plan | None, machine: Machine, policy: Policy | None,
             backend: Backend | None, fallback: Fallback | None, feeds: tuple, reference: Any = None) -> Scheduled:
        return ScheduledKeras(self.network, feeds, graph=graph, plan=plan, machine=machine, policy=policy,
                              backend=backend, fallback=fallback)

    def configs(self, graph: OpGraph, feeds: tuple, backend: Backend, machine: Machine) -> dict[str, Config]:
        from opsched.backends.tf_cpu import tf_default, tf_recommended

        tf_backend: Any = backend
        want = keras_eager(self.network, feeds)
        out = {}
        for name, st in (("tf-default", tf_default()), ("tf-recommended", tf_recommended(machine))):
            desc = f"{'TF picks: ' if st.inter == st.intra == 0 else ''}inter={st.inter}, intra={st.intra}"
            same = outputs_equal(tf_backend.execute_settings(graph, st, list(feeds)), want, *self.tolerance)
            out[name] = Config(lambda st=st: float(tf_backend.measure(graph, st, repeats=1, warmup=0,
                                                                       inputs=list(feeds))[0]), desc, same)
        return out

    def note(self) -> str | None:
        return ("tf: '= eager' compares with eager Keras, model(x); a plan runs with one process-wide intra-op "
                "pool, its order and co-running as control dependencies (opsched.backends.tf_cpu)")


__all__ = ["TF_ATOL", "TF_RTOL", "KerasAdapter", "ScheduledKeras", "keras_eager"]
