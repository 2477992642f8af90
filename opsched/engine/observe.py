"""Observation building for :class:`~opsched.envs.schedule_env.ScheduleEnv`.

Split in two so a step costs little: :func:`prepare_episode` computes, once
per (graph, machine, model, max_nodes), everything that does not change
during an episode (coarsening, the simulator's tables, the reward reference,
the padded static features and edges); :func:`observe` and
:func:`action_mask` then read the simulator's state with a few vectorised
numpy operations per step.  Column meanings live in :mod:`opsched.engine.layout`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # for the annotation only: the numpy scheduler runs without gymnasium
    import gymnasium

from opsched.engine.coarsen import Coarsening, coarsen
from opsched.engine.layout import (
    DYNAMIC_FEATURES,
    HARDWARE_FEATURES,
    LEVEL_KEY,
    MAX_DEVICES,
    MAX_LEVELS,
    STATIC_FEATURES,
    obs_shapes,
)
from opsched.engine.sim import SimState, SimStatic, lower_bound, prepare
from opsched.errors import GraphError, MachineError
from opsched.graph import KIND_INDEX, OpGraph
from opsched.machine import Machine
from opsched.plan import Plan

_S = {k: i for i, k in enumerate(STATIC_FEATURES)}
_D = {k: i for i, k in enumerate(DYNAMIC_FEATURES)}
_H = {k: i for i, k in enumerate(HARDWARE_FEATURES)}
#: thread count standing for "no such level" (never fits)
_NO_LEVEL = 1 << 30


def observation_space(max_nodes: int, max_edges: int) -> gymnasium.spaces.Dict:
    """The Dict of Boxes every ScheduleEnv with these sizes observes (keys:
    :data:`OBS_KEYS`, each flattened row-major from :func:`~opsched.engine.layout.obs_shapes`)."""
    # gymnasium imported here, not at module level: the exported numpy scheduler
    # builds observations with this module where gymnasium is not installed.
    from gymnasium import spaces

    out = {}
    for key, shape in obs_shapes(max_nodes, max_edges).items():
        size = int(np.prod(shape))
        if key == "edge_index":
            out[key] = spaces.Box(0, max(max_nodes - 1, 0), shape=(size,), dtype=np.int64)
        elif key == LEVEL_KEY:
            out[key] = spaces.Box(-1.0, 1.0, shape=(size,), dtype=np.float32)
        else:
            out[key] = spaces.Box(0.0, 1.0, shape=(size,), dtype=np.float32)
    return spaces.Dict(out)


def check_machine(machine: Machine) -> None:
    """The env's fixed layout fits at most MAX_DEVICES devices and MAX_LEVELS levels."""
    if len(machine.devices) > MAX_DEVICES:
        raise MachineError(f"machine {machine.name!r} has {len(machine.devices)} devices; the environment "
                           f"supports at most MAX_DEVICES={MAX_DEVICES}")
    for dev in machine.devices:
        if len(dev.thread_levels()) > MAX_LEVELS:
            raise MachineError(f"machine {machine.name!r}: device {dev.id} has {len(dev.thread_levels())} thread "
                               f"levels {dev.thread_levels()}; the environment supports at most "
                               f"MAX_LEVELS={MAX_LEVELS} (up to 128 cores)")


@dataclass(eq=False)
class EpisodeData:
    """Everything static about one (graph, machine) episode."""

    graph: OpGraph              # the graph the plan is for (original)
    machine: Machine
    coarsening: Coarsening      # .graph is what the episode schedules
    static: SimStatic           # simulator tables of the scheduled graph
    reference: float            # reward reference: sequential makespan (s)
    lower_bound: float          # lower_bound(original graph) (s)
    max_nodes: int
    node_static: np.ndarray     # (N, F_s) float32
    node_mask: np.ndarray       # (N,) float32
    edge_index: np.ndarray      # (2, E) int64
    edge_mask: np.ndarray       # (E,) float32
    hw_static: np.ndarray       # (MAX_DEVICES, F_h) float32, dynamic columns 0
    level_threads: np.ndarray   # (MAX_DEVICES, MAX_LEVELS) int64, _NO_LEVEL where absent
    slots: np.ndarray           # (n_dev,) float
    mem_capacity: np.ndarray    # (n_dev,) bytes
    log_nodes: float
    node_levels: np.ndarray     # (N, MAX_LEVELS) float32: level_features of the scheduled graph
    hint_after: tuple[tuple[int, ...], ...] = ()  # per slot, the slots the hinted plan holds it for
    hint_follow: Any = None     # engine/slots.Follow of the hint: what a decoded plan follows member by member
    fits_cache: dict = field(default_factory=dict)  # free slots per device -> flat (device, level) fits
    projections: dict = field(default_factory=dict)  # id(plan) -> (plan, SlotPlan): engine/slots.from_plan's cache

    @property
    def n(self) -> int:
        return self.static.n


def prepare_episode(graph: OpGraph, machine: Machine, model: Any, max_nodes: int, max_edges: int,
                    hint: Plan | None = None) -> EpisodeData:
    """Everything static about one episode (see :class:`EpisodeData`).  ``hint``:
    the best heuristic's Plan for ``graph`` (``opsched.policies.hints``), read
    into the ``hint_*`` columns of ``node_static``; without one they are 0."""
    if not graph.ops:
        raise GraphError(f"graph {graph.name!r} has no ops: there is nothing to schedule")
    check_machine(machine)
    full = prepare(graph, machine, model)
    fastest = full.table.times.min(axis=(1, 2))
    co = coarsen(graph, max_nodes, cost=fastest, max_edges=max_edges)
    static = full if co.identity else SimStatic(co.graph, machine, full.model, table=co.table(full.table))
    cpu = machine.device_index["cpu"]
    reference = float(static.table.on(cpu, machine.cpu.cores).sum())
    n = static.n
    feats = node_static_features(co.graph, static, machine, reference)
    node_static = np.zeros((max_nodes, len(STATIC_FEATURES)), np.float32)
    node_static[:n] = feats
    node_mask = np.zeros(max_nodes, np.float32)
    node_mask[:n] = 1.0
    pairs = sorted(co.graph.edge_bytes)
    edge_index = np.zeros((2, max_edges), np.int64)
    edge_mask = np.zeros(max_edges, np.float32)
    if pairs:
        edge_index[:, : len(pairs)] = np.array(pairs, dtype=np.int64).T
        edge_mask[: len(pairs)] = 1.0
    hw = np.zeros((MAX_DEVICES, len(HARDWARE_FEATURES)), np.float32)
    lt = np.full((MAX_DEVICES, MAX_LEVELS), _NO_LEVEL, np.int64)
    for d, dev in enumerate(machine.devices):
        hw[d, _H["present"]] = 1.0
        hw[d, _H["is_gpu"]] = float(dev.is_gpu)
        hw[d, _H["log_cores"]] = min(math.log2(dev.cores) / 7.0, 1.0)
        hw[d, _H["log_gflops"]] = min(max(math.log10(dev.gflops) / 5.0, 0.0), 1.0)
        hw[d, _H["log_bandwidth"]] = min(max(math.log10(dev.mem_bandwidth_gbs) / 4.0, 0.0), 1.0)
        if dev.is_gpu:
            hw[d, _H["log_link_host"]] = _log_link(machine, dev.id, ("cpu",))
            hw[d, _H["log_link_peer"]] = _log_link(machine, dev.id, [g.id for g in machine.gpus if g.id != dev.id])
        levels = dev.thread_levels()
        lt[d, : len(levels)] = levels
    cpu_levels = static.table.levels[cpu]
    node_levels = level_features(static.table.times[:, cpu, :len(cpu_levels)], cpu_levels, max_nodes)
    data = EpisodeData(
        graph=graph, machine=machine, coarsening=co, static=static, reference=reference, node_levels=node_levels,
        lower_bound=lower_bound(graph, machine, full.model), max_nodes=max_nodes,
        node_static=node_static, node_mask=node_mask, edge_index=edge_index, edge_mask=edge_mask,
        hw_static=hw, level_threads=lt, slots=np.array([d.cores for d in machine.devices], float),
        mem_capacity=np.array([max(d.memory_gb, 1e-9) * 1e9 for d in machine.devices]),
        log_nodes=min(math.log2(max(n, 1)) / 10.0, 1.0),
    )
    if hint is not None:
        attach_hint(data, hint)
    return data


def attach_hint(data: EpisodeData, hint: Plan) -> None:
    """Read ``hint`` (a Plan for ``data.graph``), projected onto the episode's
    slots, into the ``hint_*`` columns of ``data.node_static`` and
    ``data.hint_after`` (the hint of :func:`prepare_episode`, for callers that
    choose it from the episode: :func:`opsched.policies.hints.slot_hint`), and
    ``data.hint_follow``: the hint's plan with that projection, which a decoded
    episode's plan follows member by member where it takes the hinted decision
    (:func:`opsched.engine.slots.to_plan`)."""
    from opsched.engine.slots import follow_of

    static, n, node_static = data.static, data.static.n, data.node_static
    data.hint_follow = follow_of(data, hint, hint.policy)
    sp = data.hint_follow.slots
    node_static[:n, _S["hint_device"]] = (np.asarray(sp.device) + 1.0) / MAX_DEVICES
    node_static[:n, _S["hint_level"]] = (np.asarray(sp.level) + 1.0) / MAX_LEVELS
    node_static[:n, _S["hint_threads"]] = [static.levels[d][lv] / static.caps[d]
                                           for d, lv in zip(sp.device, sp.level, strict=True)]
    node_static[:n, _S["hint_order"]] = 1.0 - np.asarray(sp.rank, float) / n
    data.hint_after = tuple(tuple(deps) for deps in sp.after)


def _log_link(machine: Machine, a: str, others: Sequence[str]) -> float:
    """log10 of the mean bandwidth (GB/s) from device ``a`` to ``others`` / 3, in [0, 1]."""
    bws = []
    for b in others:
        link = machine.link(a, b)
        if link is not None:
            bws.append(link.bandwidth_gbs)
    return min(max(math.log10(float(np.mean(bws))) / 3.0, 0.0), 1.0) if bws else 0.0


def level_features(times: np.ndarray, levels: Sequence[int], max_nodes: int, max_levels: int = MAX_LEVELS) -> np.ndarray:
    """(max_nodes, max_levels) float32: ``log2(t(1) / t(k_l)) / 7`` per op and CPU
    thread level ``k_l`` (the op's speed-up there, log scale, clipped to [-1, 1]);
    0 for padding and for levels the device lacks.

    ``times`` is (n_ops, n_levels): the performance model's time of each
    scheduled op (group) on the CPU at each of its ``levels``.  Why: the best
    thread count is where an op's time curve bottoms out, and the static
    features give only two points of that curve (1 thread and all cores)."""
    out = np.zeros((max_nodes, max_levels), np.float32)
    n, nl = times.shape[0], min(len(levels), max_levels)
    if n:
        t1 = np.maximum(times[:, :1], 1e-30)
        out[:n, :nl] = np.clip(np.log2(t1 / np.maximum(times[:, :nl], 1e-30)) / 7.0, -1.0, 1.0)
    return out


def node_static_features(graph: OpGraph, static: SimStatic, machine: Machine, reference: float) -> np.ndarray:
    """(n, len(STATIC_FEATURES)) float32; see :data:`opsched.engine.layout.STATIC_FEATURES`."""
    n = len(graph.ops)
    out = np.zeros((n, len(STATIC_FEATURES)), np.float32)
    if n == 0:
        return out
    out[np.arange(n), [KIND_INDEX[op.kind] for op in graph.ops]] = 1.0
    flops = np.array([op.flops for op in graph.ops])
    nbytes = np.array([op.bytes_total for op in graph.ops])
    out[:, _S["log_flops"]] = np.clip(np.log10(1.0 + flops) / 12.0, 0.0, 1.0)
    out[:, _S["log_bytes"]] = np.clip(np.log10(1.0 + nbytes) / 10.0, 0.0, 1.0)
    times = static.table.times
    cpu = machine.device_index["cpu"]
    cores = machine.cpu.cores
    t1 = times[:, cpu, 0]
    t_all = times[:, cpu, static.level_index[cpu][cores]]
    out[:, _S["time_1"]] = t1 / max(float(t1.sum()), 1e-30)
    out[:, _S["scaling"]] = np.clip(t1 / (cores * np.maximum(t_all, 1e-30)), 0.0, 1.0)
    fastest = times.min(axis=(1, 2))
    out[:, _S["best_time"]] = np.clip(fastest / reference, 0.0, 1.0)
    rank = graph.upward_rank_array(fastest)
    out[:, _S["upward_rank"]] = rank / max(float(rank.max()), 1e-30)
    out[:, _S["in_degree"]] = np.minimum([len(p) / 8.0 for p in graph.pred_index], 1.0)
    out[:, _S["out_degree"]] = np.minimum([len(s) / 8.0 for s in graph.succ_index], 1.0)
    gpus = [d for d, dev in enumerate(machine.devices) if dev.is_gpu]
    if gpus:
        out[:, _S["gpu_time"]] = np.clip(times[:, gpus[0], 0] / reference, 0.0, 1.0)
        slowest = min(link.bandwidth_gbs for link in machine.links) if machine.links else 1e3
        xfer = np.array([op.bytes_written for op in graph.ops]) / (slowest * 1e9)
        out[:, _S["comm_ratio"]] = np.clip(np.log10(1.0 + xfer / np.maximum(fastest, 1e-30)) / 3.0, 0.0, 1.0)
    return out


_HW_DYN = slice(_H["free_frac"], _H["mem_frac"] + 1)
_HINT_FREE = _D["hint_free"]
assert (_H["busy_until"], _H["mem_frac"]) == (_H["free_frac"] + 1, _H["free_frac"] + 2)


class Observer:
    """Builds observations (and action masks) of one episode incrementally.

    The per-op state columns change only when an op becomes ready, starts or
    finishes, so the env reports those transitions (:meth:`ready`,
    :meth:`started`, :meth:`completed`) and :meth:`observe` only fills in
    what moves with time (remaining times, the hardware rows, the globals).
    Pinned against the from-scratch :func:`observe` by the tests.
    """

    def __init__(self, data: EpisodeData, st: SimState) -> None:
        self.data = data
        self.st = st
        self.dyn = np.zeros((data.max_nodes, len(DYNAMIC_FEATURES)), np.float32)
        self.dyn[: data.n, _D["waiting"]] = 1.0
        self.ready_vec = np.zeros(data.max_nodes, dtype=bool)
        self._slots = data.slots.tolist()
        self._mem_cap = data.mem_capacity.tolist()
        self._fits: dict[tuple[int, ...], np.ndarray] = data.fits_cache
        # the hinted plan's holds: per slot, how many of the slots it waits for are not done
        self._hint_pending = [len(deps) for deps in data.hint_after] if data.hint_after else None
        if self._hint_pending is not None:
            self._hint_succ: list[list[int]] = [[] for _ in range(data.n)]
            for i, deps in enumerate(data.hint_after):
                for j in deps:
                    self._hint_succ[j].append(i)
        self.ready(list(st.newly_ready))

    def ready(self, ops: list[int]) -> None:
        if ops:
            self.dyn[ops, _D["waiting"]] = 0.0
            self.dyn[ops, _D["ready"]] = 1.0
            self.ready_vec[ops] = True
            pending = self._hint_pending
            if pending is not None:
                self.dyn[[i for i in ops if not pending[i]], _HINT_FREE] = 1.0

    def started(self, i: int, d: int, threads: int) -> None:
        self.dyn[i, 1:6] = (0.0, 1.0, 0.0, (d + 1) / MAX_DEVICES, threads / self._slots[d])
        self.dyn[i, _HINT_FREE] = 0.0
        self.ready_vec[i] = False

    def completed(self, ops: list[int]) -> None:
        self.dyn[ops, 2:4] = (0.0, 1.0)
        self.dyn[ops, _D["remaining"]] = 0.0
        pending = self._hint_pending
        if pending is not None:
            for c in ops:
                for j in self._hint_succ[c]:
                    pending[j] -= 1
                    if not pending[j] and self.ready_vec[j]:
                        self.dyn[j, _HINT_FREE] = 1.0

    def _fitting(self) -> np.ndarray:
        """Flat (device, level) mask: the levels whose thread counts fit in the free slots now."""
        key = tuple(self.st.free)
        fits = self._fits.get(key)
        if fits is None:
            free = np.zeros(MAX_DEVICES, np.int64)
            free[: len(key)] = key
            fits = self._fits[key] = (self.data.level_threads <= free[:, None]).reshape(-1)
        return fits

    def action_mask(self) -> np.ndarray:
        """Joint boolean mask over the flat action space (see :func:`action_mask`)."""
        n_max = self.data.max_nodes
        out = np.empty(n_max * MAX_DEVICES * MAX_LEVELS + 1, dtype=bool)
        np.logical_and(self.ready_vec[:, None], self._fitting()[None, :], out=out[:-1].reshape(n_max, -1))
        out[-1] = self.st.n_running > 0
        return out

    def choices(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """The valid actions in factored form: the ready ops (ascending slots),
        the (device, level) columns that fit now (ascending), and whether
        "wait" is valid.  The valid starts are every (op, column) pair - the
        :meth:`action_mask` is their outer product - so a planner scores a
        (ops x columns) grid instead of scanning the whole flat mask."""
        return self.ready_vec.nonzero()[0], self._fitting().nonzero()[0], self.st.n_running > 0

    def observe(self) -> dict[str, np.ndarray]:
        """The current observation (fresh arrays every call)."""
        data = self.data
        dyn, hw, globals_ = self.state()
        return {
            "node_static": data.node_static.copy(),
            "node_dynamic": dyn,
            "node_mask": data.node_mask.copy(),
            "edge_index": data.edge_index.copy(),
            "edge_mask": data.edge_mask.copy(),
            "hardware": hw,
            "globals": globals_,
            LEVEL_KEY: data.node_levels.copy(),
        }

    def state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The parts of :meth:`observe` that change within an episode, as fresh
        arrays: ``node_dynamic``, ``hardware``, ``globals`` (what a planner that
        holds the static parts already needs at each decision)."""
        data, st = self.data, self.st
        ref = data.reference
        dyn = self.dyn.copy()
        free, slots, mem, cap = st.free, self._slots, st.mem_bytes, self._mem_cap
        nd = len(slots)
        busy = [0.0] * nd
        running = st.running
        if running:
            rows = list(running)
            rem = []
            device = st.device
            for i in rows:
                r = st.remaining(i) / ref
                if r > 1.0:
                    r = 1.0
                rem.append(r)
                d = device[i]
                if r > busy[d]:
                    busy[d] = r
            dyn[rows, _D["remaining"]] = rem
        hw = data.hw_static.copy()
        hw[:nd, _HW_DYN] = [(free[d] / slots[d], busy[d], min(mem[d] / cap[d], 1.0)) for d in range(nd)]
        now = st.now
        n = data.n
        return dyn, hw, np.array((now / (now + ref), st.n_done / n, st.n_ready / n, data.log_nodes), np.float32)
