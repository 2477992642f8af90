"""What users get without a scheduler: eager execution, TensorFlow's thread
settings, and a random plan.

These are the baselines every other policy is measured against.  Each one is
a plain :class:`~opsched.plan.Plan`, so the simulator and the real runtimes
execute them exactly like any learned plan.
"""

from __future__ import annotations

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Device, Machine
from opsched.plan import Assignment, Plan
from opsched.policies.base import (
    Policy,
    build_plan,
    default_device,
    full_threads,
    resolve_model,
    snap_threads,
    topo_priorities,
    window_after,
)
from opsched.policies.registry import BASELINE, CONTROL, HINT, TEACHER, register

#: Op kinds TensorFlow's CPU runtime hands to a library kernel (oneDNN / Eigen
#: contraction) that always spreads over the whole intra-op pool.
LIBRARY_KINDS = frozenset({"conv", "matmul", "rnn", "attention"})
#: Eigen's ``TensorCostModel`` constants: a thread is worth starting per
#: 100,000 cycles of work, after 100,000 cycles of start-up.
EIGEN_STARTUP_CYCLES = 1e5
EIGEN_PER_THREAD_CYCLES = 1e5
#: The nominal clock used to turn a predicted single-thread time into cycles.
NOMINAL_CLOCK_HZ = 2.0e9


@register("sequential", roles=(BASELINE, HINT, TEACHER), aliases=("eager",), order=0)
class Sequential(Policy):
    """Framework eager execution: one op at a time, topological order, the
    whole default device (all CPU cores, or GPU 0's one stream).

    Under the plan semantics, an op with all cores already cannot co-run; the
    ``after`` chain makes "one at a time" hold on GPUs too (where an op takes
    one of several stream slots), and pins the order, as eager execution does.
    """

    name = "sequential"

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        dev = default_device(machine)
        order = graph.topo_index
        prio = topo_priorities(graph, order)
        after = window_after(graph, order, 1)
        threads = full_threads(dev)
        assignments = {op.id: Assignment(dev.id, threads, float(prio[i]), after[i])
                       for i, op in enumerate(graph.ops)}
        return build_plan(graph, machine, assignments, policy=self.name, device=dev.id, threads=threads)


class TFSettings(Policy):
    """TensorFlow's CPU runtime under given ``intra_op`` / ``inter_op`` settings.

    How the two settings map onto a Plan (TensorFlow itself applies them for
    real on the TF backend, which reads ``plan.meta['intra_op']`` and
    ``plan.meta['inter_op']``):

    * ``inter_op`` is the size of the executor's inter-op pool: at most that
      many ops are in flight at once, taken from the ready queue first in,
      first out.  FIFO becomes topological priority; the limit becomes an
      ``after`` window (op k waits for op k - inter_op, see
      :func:`~policies.base.window_after`) when it is below the device's core
      count, and is implied by the core slots otherwise.
    * ``intra_op`` is the shared Eigen/oneDNN pool one op spreads over.
      Library kernels (conv, matmul, rnn, attention) use the whole pool;
      Eigen's other kernels pick their own parallelism with its cost model,
      ``threads = (cycles - 1e5) / 1e5 + 0.9``, so small ops run on one thread.
      Per-op threads are that, capped at ``intra_op`` and the physical cores
      (a plan cannot oversubscribe; SMT siblings are not extra slots).
    * On a machine with GPUs TensorFlow places every op on GPU 0, whose single
      compute stream runs them one at a time; the thread settings then only
      govern host work.
    """

    name = "tf-settings"

    def settings(self, machine: Machine) -> tuple[int, int]:
        """(intra_op, inter_op) for this machine."""
        raise NotImplementedError

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        intra, inter = self.settings(machine)
        dev = default_device(machine)
        order = graph.topo_index
        prio = topo_priorities(graph, order)
        if dev.is_gpu:
            threads = np.ones(len(graph.ops), dtype=int)
            window = 1
        else:
            threads = self._eigen_threads(graph, dev, intra, resolve_model(model))
            window = inter
        after = window_after(graph, order, window) if window < dev.cores else [()] * len(graph.ops)
        assignments = {op.id: Assignment(dev.id, int(threads[i]), float(prio[i]), after[i])
                       for i, op in enumerate(graph.ops)}
        return build_plan(graph, machine, assignments, policy=self.name, intra_op=intra, inter_op=inter,
                          device=dev.id)

    @staticmethod
    def _eigen_threads(graph: OpGraph, dev: Device, intra: int, model: PerfModel) -> np.ndarray:
        cap = max(1, min(intra, dev.cores))
        out = np.empty(len(graph.ops), dtype=int)
        for i, op in enumerate(graph.ops):
            if op.kind in LIBRARY_KINDS:
                want = cap
            else:
                cycles = model.op_time(op, dev, 1) * NOMINAL_CLOCK_HZ
                want = int((cycles - EIGEN_STARTUP_CYCLES) / EIGEN_PER_THREAD_CYCLES + 0.9)
            want = max(1, min(want, cap))
            out[i] = cap if want == cap else snap_threads(dev, want)
        return out


@register("tf-default", roles=(BASELINE, HINT, TEACHER), order=1)
class TFDefault(TFSettings):
    """TensorFlow's defaults: ``intra_op_parallelism_threads = 0`` and
    ``inter_op_parallelism_threads = 0``, which TF resolves to the number of
    logical cores for both."""

    name = "tf-default"

    def settings(self, machine: Machine) -> tuple[int, int]:
        cpu = machine.cpu
        logical = cpu.cores * max(1, cpu.smt)
        return logical, logical


@register("tf-recommended", roles=(BASELINE, HINT, TEACHER), order=2)
class TFRecommended(TFSettings):
    """The setting Intel's and TensorFlow's performance guides recommend on
    CPUs (and the baseline of Liu et al.): intra-op threads = physical cores
    per socket, inter-op threads = number of sockets."""

    name = "tf-recommended"

    def settings(self, machine: Machine) -> tuple[int, int]:
        cpu = machine.cpu
        return cpu.cores_per_socket, max(1, cpu.sockets)


@register("random", roles=(CONTROL,), order=6)
class RandomPolicy(Policy):
    """A random valid plan: each op gets a random device, a random thread level
    of that device and a random priority (seeded, so reproducible)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        rng = np.random.default_rng(self.seed)
        devices = machine.devices
        assignments = {}
        for op in graph.ops:
            dev = devices[int(rng.integers(len(devices)))]
            levels = dev.thread_levels()
            threads = levels[int(rng.integers(len(levels)))]
            assignments[op.id] = Assignment(dev.id, int(threads), float(rng.random()))
        return build_plan(graph, machine, assignments, policy=self.name, seed=self.seed)
