"""The scheduling environment: one graph on one machine, decided op by op."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.error import ResetNeeded

from opsched.engine.episode import Episode
from opsched.engine.layout import EDGES_PER_NODE, MAX_DEVICES, MAX_LEVELS, ActionLayout, flatten_obs
from opsched.engine.observe import EpisodeData, observation_space, prepare_episode
from opsched.engine.sim import SimState
from opsched.engine.slots import episode_plan
from opsched.errors import OpschedError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan, uniform_plan
from opsched.trace import Trace

GraphSource = OpGraph | str | Sequence[OpGraph | str] | Callable[[np.random.Generator], OpGraph]
MachineSource = Machine | str | Sequence[Machine | str]

#: Default graphs of a bare ``gym.make(ENV_ID)``: a fresh random DAG per
#: episode from opsched's synthetic families, 20 to 60 ops (no torch needed).
DEFAULT_SIZES = (20, 60)


def random_graph(rng: np.random.Generator) -> OpGraph:
    """A random DAG of a random synthetic family with 20-60 ops (the default graphs)."""
    from opsched.synthetic import FAMILIES, generate

    family = sorted(FAMILIES)[int(rng.integers(len(FAMILIES)))]
    return generate(family, int(rng.integers(DEFAULT_SIZES[0], DEFAULT_SIZES[1] + 1)), int(rng.integers(2**31)))


class InvalidActionError(OpschedError, ValueError):
    """An action the current state does not allow (the message says why)."""


class MaskedDiscrete(spaces.Discrete):
    """A ``Discrete`` space whose :meth:`sample` (without an explicit mask)
    draws a currently *valid* action of the environment it is bound to.

    Random agents, ``gymnasium``'s and SB3's ``check_env`` and SB3's NaN
    check sample actions from the space; since the env rejects invalid actions
    loudly, the space samples through the env's ``action_masks()``.  The
    binding is a weak reference and is dropped when the space is pickled or
    copied (a copy samples uniformly, like a plain ``Discrete``)."""

    def __init__(self, n: int, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(n, seed=seed)
        self._masks: weakref.WeakMethod | None = None

    def bind(self, env: ScheduleEnv) -> None:
        self._masks = weakref.WeakMethod(env.action_masks)

    def sample(self, mask: np.ndarray | None = None, probability: np.ndarray | None = None) -> np.int64:
        if mask is None and probability is None and self._masks is not None:
            fn = self._masks()
            if fn is not None:
                try:
                    mask = fn().astype(np.int8)
                except ResetNeeded:
                    mask = None
        return super().sample(mask=mask, probability=probability)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_masks"] = None
        return state


class ScheduleEnv(gym.Env[dict, np.int64]):
    """Schedule one operation graph on one machine: which ready op starts next,
    with how many threads, on which device -- or wait.

    ## Description

    An episode executes one graph (an :class:`~opsched.graph.OpGraph`) on one
    machine in the discrete-event simulator (:mod:`opsched.engine.sim`).
    It is event driven, as in Decima: the agent is asked to act only at
    decision points, i.e. when some ready op could start now.  Each action
    either starts one ready op (on a device, with a thread count) at the
    current time, or waits for the next op to finish.  When no ready op fits
    anywhere, time advances to the next completion without asking.  Ops
    started together co-run, slowing each other per the performance model's
    interference term; an input produced on another device pays a transfer.

    The decisions are recorded as a :class:`~opsched.plan.Plan`: priority =
    dispatch order (the first op started has the highest), and an op started
    later than the moment it became ready gets, in ``after``, an op that
    finished exactly when it was started.  Replaying ``info["plan"]`` with
    ``SimBackend(machine, model).run(graph, plan)`` reproduces the episode's
    makespan exactly (when the graph was not coarsened and ``noise == 0``).

    ## Action Space

    ``MaskedDiscrete(max_nodes * MAX_DEVICES * MAX_LEVELS + 1)`` (a
    ``Discrete``), flat so that its mask is joint (MaskablePPO masks the
    dimensions of a ``MultiDiscrete`` independently, which cannot say "this
    thread count is valid for this op on this device"):

    | index | action |
    |---|---|
    | ``(slot * MAX_DEVICES + device) * MAX_LEVELS + level`` | start the op in ``slot`` on ``machine.devices[device]`` with ``device.thread_levels()[level]`` threads |
    | ``max_nodes * MAX_DEVICES * MAX_LEVELS`` | wait for the next completion |

    ``slot`` is the op's index in the scheduled graph (the coarsened one for a
    graph larger than ``max_nodes``); ``MAX_DEVICES = 8``, ``MAX_LEVELS = 8``
    (:mod:`opsched.engine.layout`, whose ``ActionLayout`` encodes and decodes).
    Thread levels are 1, 2, 4, ... below the device's cores, plus all cores
    (GPUs: 1 stream slot).  :meth:`action_masks` gives the valid actions:
    ready op x device x level whose thread count is free now, and "wait"
    while an op runs.  Any other action raises :class:`InvalidActionError`
    naming the op, device and reason.  ``action_space.sample()`` draws a
    valid action.

    ## Observation Space

    A ``Dict`` of 1-D ``Box``es, padded to ``N = max_nodes`` op slots and
    ``E = max_edges`` edges; each key is its logical shape below flattened
    row-major (``opsched.engine.layout.unflatten_obs`` restores the shapes).  Every float lies in [0, 1] (``node_levels``:
    [-1, 1]); times are divided
    by the episode's reference (below), so one policy sees graphs of any size
    on machines of any speed.

    | key | shape, dtype | content |
    |---|---|---|
    | ``node_static`` | (N, 25) float32 | per op: one-hot kind (11, ``OP_KINDS`` order); ``log_flops`` = log10(1+FLOPs)/12; ``log_bytes`` = log10(1+bytes moved)/10; ``time_1`` = CPU time at 1 thread / sum over ops of it; ``scaling`` = parallel efficiency at all CPU cores, t(1)/(cores * t(all)); ``best_time`` = fastest time over devices and levels / reference; ``upward_rank`` = upward rank at fastest times / critical path; ``in_degree``, ``out_degree`` = degree/8 (clipped); ``gpu_time`` = time on the first GPU / reference (0 without GPUs); ``comm_ratio`` = log10(1 + output transfer over the slowest link / fastest time)/3; the best heuristic's plan (``opsched.policies.hints``): ``hint_device`` = (device index+1)/MAX_DEVICES, ``hint_threads`` = threads / device slots, ``hint_order`` = 1 - place in its dispatch order / ops |
    | ``node_dynamic`` | (N, 7) float32 | per op: one-hot ``waiting``, ``ready``, ``running``, ``done``; ``device_frac`` = (device index+1)/MAX_DEVICES once started; ``threads_frac`` = threads / device slots once started; ``remaining`` = predicted time to finish / reference (running ops) |
    | ``node_mask`` | (N,) float32 | 1 for a real op slot, 0 for padding |
    | ``edge_index`` | (2, E) int64 | row 0 source slot, row 1 target slot of each data edge (one per op pair); 0 in padding |
    | ``edge_mask`` | (E,) float32 | 1 for a real edge |
    | ``hardware`` | (8, 10) float32 | per device (rows beyond the machine's devices are 0): ``present``, ``is_gpu``, ``log_cores`` = log2(slots)/7, ``free_frac`` = free slots/slots, ``busy_until`` = (latest predicted end there - now)/reference, ``mem_frac`` = live tensor bytes / memory, ``log_gflops`` = log10(GFLOP/s)/5, ``log_bandwidth`` = log10(GB/s)/4, ``log_link_host`` / ``log_link_peer`` = log10(link GB/s)/3 to the CPU / mean to the other GPUs (GPUs only) |
    | ``globals`` | (4,) float32 | ``time`` = now/(now+reference), ``frac_done``, ``frac_ready``, ``log_nodes`` = log2(ops)/10 |
    | ``node_levels`` | (N, 8) float32 | per op and CPU thread level k: log2(t(1)/t(k))/7, the op's predicted speed-up, clipped to [-1, 1]; 0 for padding and absent levels |

    Columns beyond 1 are clipped to 1 (``node_levels``: to [-1, 1]).  The column names are the tuples
    ``STATIC_FEATURES``, ``DYNAMIC_FEATURES``, ``HARDWARE_FEATURES`` and
    ``GLOBAL_FEATURES`` of :mod:`opsched.engine.layout`.

    ## Rewards

    ``-dt / reference`` at every step, where ``dt`` is the simulated time the
    step advanced (0 when an op is started and another decision follows at
    the same time) and ``reference`` the graph's *sequential makespan*: every
    op alone, one after another, with all CPU cores, in the simulator.  The
    return of an episode is therefore ``-makespan / reference`` (> -1 means
    faster than sequential), comparable across graphs.

    Real mode (``ScheduleReal-v0``, ``backend="torch-cpu"`` or ``"tf"``): the decisions
    are taken against the simulator exactly as above; when the last op
    finishes, the episode's Plan is executed on the real backend
    (``real_warmup`` runs discarded, then ``real_repeats`` timed runs; the
    median makespan) and the final step's reward is
    ``-(measured_makespan - t_before) / reference`` with ``t_before`` the
    simulated time before that step, so the return is
    ``-measured_makespan / reference``.  There ``reference`` defaults to the
    *measured* makespan of the sequential plan (all ops one at a time with all
    CPU cores, ``reference="measured"``), measured once per graph;
    ``reference="sim"`` keeps the simulated one.  Measurements are cached by
    plan hash, so a repeated plan is not re-run.  The graph must carry the
    backend's executable source: torch-cpu runs graphs imported from PyTorch,
    ``tf`` graphs imported from Keras (``opsched.importers.tf_graph``); there a
    run is one traced TensorFlow run and its makespan the span of TF's own
    step stats (see :mod:`opsched.backends.tf_cpu` for how a Plan maps onto TF).

    ## Starting State

    Time 0, nothing started; the source ops are ready and every device is
    free.  The graph and machine are ``options["graph"]`` /
    ``options["machine"]`` when given, else drawn with ``self.np_random``
    from the configured ``graphs`` / ``machine`` lists.

    ## Episode End

    Terminated when every op has finished.  Never truncated (an episode has
    at most ``2 * ops`` steps: each step starts an op or waits for one to
    end).  The final ``info`` holds ``plan`` (a Plan for the *original* graph,
    every op covered), ``plan_followed`` (the same decisions following the
    hint's plan member by member where they took the hinted one,
    :func:`opsched.engine.slots.to_plan`: what an exported policy plans and
    validation scores; ``plan`` itself without a hint; real mode measures
    it), ``trace`` (the simulated Trace of the scheduled graph),
    ``makespan`` (seconds: simulated, or measured in real mode),
    ``sim_makespan``, ``reference``, ``lower_bound`` (of the original graph,
    :func:`opsched.engine.sim.lower_bound`) and ``coarsened``; in real mode
    also ``measured_trace`` and ``measured_op_times`` (op id -> median
    seconds over the repeats, ready to feed a profile).

    ## Arguments

    ```python
    gym.make("opsched/Schedule-v0")                    # random DAGs on this machine
    gym.make("opsched/Schedule-v0", graphs=["zoo:inception", "layered:60:3"], machine="knl-68")
    ```

    * ``graphs``: graph spec strings (:mod:`opsched.specs`, the grammar of
      the command line: ``zoo:NAME[@BxW]``, ``FAMILY:N:SEED``, a ``.json``
      file ...), OpGraphs, a sequence of either, or a callable taking the env's
      ``np_random`` and returning an OpGraph.  Default: a fresh random DAG per
      episode (a synthetic family, 20-60 ops).
    * ``machine``: a machine spec (``"local"``, a preset, a YAML path,
      ``cpu:CORES:GFLOPS:GBS``), a Machine, or a sequence of them; default
      ``"local"`` (this machine, probed).
    * ``max_nodes`` (128): op slots; a larger graph is coarsened
      (:mod:`opsched.engine.coarsen`) into at most this many groups, never
      truncated.  ``max_edges`` (default ``4 * max_nodes``): edge slots; the
      coarsening also keeps the group edges within it.
    * ``model``: the performance model (default: the analytic one).
    * ``noise`` (0.0): sigma of a lognormal factor on every op's simulated
      time, drawn per episode from ``np_random``.
    * ``backend`` ("sim"): ``"torch-cpu"``, ``"tf"`` (or another real backend
      of :mod:`opsched.backends.registry`) for real mode, or an open real
      Backend instance (shared, e.g. to reuse TensorFlow worker processes; the
      env does not close it, and ``machine`` defaults to its machine);
      ``real_warmup`` (1), ``real_repeats`` (3), ``reference`` ("sim" / "measured").
    * ``hint_plan`` (True): the ``hint_*`` columns hold the best hint
      heuristic's plan (chosen among the ``hint`` heuristics and those the
      default plan-time search adds for the graph,
      :func:`opsched.policies.hints.episode_heuristics`); False: they are 0
      (a policy that stands on its own, the ``hint_observation`` training
      setting).
    * ``render_mode``: ``None`` or ``"ansi"`` (a text summary of the state).

    ## Version History

    * v0: initial version; ``node_levels``, the link features and the best
      heuristic's plan (``hint_*``) are part of the observation, graphs and
      machines take spec strings, and ``graphs`` defaults to random DAGs.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, graphs: GraphSource | None = None, machine: MachineSource | None = None,
                 max_nodes: int = 128, max_edges: int | None = None, model: Any = None, noise: float = 0.0,
                 backend: str | Any = "sim", real_warmup: int = 1, real_repeats: int = 3,
                 reference: str | None = None, render_mode: str | None = None, hint_plan: bool = True) -> None:
        super().__init__()
        if not isinstance(max_nodes, (int, np.integer)) or max_nodes < 1:
            raise ValueError(f"ScheduleEnv: max_nodes must be a positive int, got {max_nodes!r}")
        max_edges = EDGES_PER_NODE * int(max_nodes) if max_edges is None else max_edges
        if not isinstance(max_edges, (int, np.integer)) or max_edges < 1:
            raise ValueError(f"ScheduleEnv: max_edges must be a positive int, got {max_edges!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"ScheduleEnv: render_mode {render_mode!r} is not one of {self.metadata['render_modes']}")
        if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
            raise ValueError(f"ScheduleEnv: noise must be a finite number >= 0, got {noise!r}")
        shared = None
        if not isinstance(backend, str):
            if not getattr(backend, "measured", False) or not callable(getattr(backend, "run", None)):
                raise ValueError(f"ScheduleEnv: backend must be a registry name or a real (measured) Backend, "
                                 f"got {type(backend).__name__}")
            shared, backend = backend, backend.name
            machine = shared.machine if machine is None else machine
        reference = reference or ("sim" if backend == "sim" else "measured")
        if reference not in ("sim", "measured"):
            raise ValueError(f"ScheduleEnv: reference must be 'sim' or 'measured', got {reference!r}")
        if backend == "sim" and reference == "measured":
            raise ValueError("ScheduleEnv: reference='measured' needs a real backend (backend='torch-cpu')")
        self.max_nodes, self.max_edges = int(max_nodes), int(max_edges)
        self.layout = ActionLayout(self.max_nodes)
        self._wait = self.layout.wait
        self.model = model
        self.hint_plan = bool(hint_plan)
        self.noise = float(noise)
        self.backend_name = backend
        self.real_warmup, self.real_repeats = int(real_warmup), int(real_repeats)
        if self.real_repeats < 1 or self.real_warmup < 0:
            raise ValueError("ScheduleEnv: real_repeats must be >= 1 and real_warmup >= 0")
        self.reference_mode = reference
        self.render_mode = render_mode
        self._graphs = self._graph_source(graphs)
        self._machines: tuple[Machine, ...] = self._machine_source(machine)
        self.observation_space = observation_space(self.max_nodes, self.max_edges)
        self.action_space = MaskedDiscrete(self.layout.n)
        self.action_space.bind(self)
        self._cache = IdentityLRU(64)  # (graph, machine) -> EpisodeData
        self._measured: dict[str, dict[str, Any]] = {}
        self._measured_reference: weakref.WeakKeyDictionary[EpisodeData, float] = weakref.WeakKeyDictionary()
        self._real = shared
        self._shared_real = shared is not None
        self._data: EpisodeData | None = None
        self._state: SimState | None = None
        self._terminated = False

    # ---------------------------------------------------------- configuration
    @staticmethod
    def _graph_source(graphs: GraphSource | None) -> Sequence[OpGraph] | Callable:
        if graphs is None:
            return random_graph
        if callable(graphs):
            return graphs
        if isinstance(graphs, (OpGraph, str)):
            graphs = (graphs,)
        out = tuple(graphs)
        bad = [type(g).__name__ for g in out if not isinstance(g, (OpGraph, str))]
        if not out or bad:
            raise TypeError(f"ScheduleEnv: graphs must be OpGraphs or graph spec strings (got {bad or 'an empty list'})")
        from opsched.specs import load_graph

        return tuple(g if isinstance(g, OpGraph) else load_graph(g) for g in out)

    @staticmethod
    def _machine_source(machine: MachineSource | None) -> tuple[Machine, ...]:
        specs = [machine] if machine is None or isinstance(machine, (Machine, str)) else list(machine)
        if not specs:
            raise TypeError("ScheduleEnv: machine must be a Machine, a preset name or a non-empty list of them")
        from opsched.specs import load_machine

        return tuple(load_machine(m) for m in specs)

    def _episode(self, graph: OpGraph, machine: Machine) -> EpisodeData:
        def make() -> EpisodeData:
            from opsched.policies.hints import attach_slot_hint, episode_heuristics, hint_names

            data = prepare_episode(graph, machine, self.model, self.max_nodes, self.max_edges)
            if self.hint_plan:  # the observation's hint_* columns (all 0 without the hint)
                plans = episode_heuristics(graph, machine, self.model, hint_names(), self.max_nodes)
                attach_slot_hint(data, plans, self.model)
            return data

        return self._cache.get_or_make((id(graph), id(machine)), make, graph, machine)

    # ------------------------------------------------------------------ API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        options = options or {}
        graph = options.get("graph")
        if isinstance(graph, str):
            from opsched.specs import load_graph

            graph = load_graph(graph)
        if graph is None:
            if callable(self._graphs):
                graph = self._graphs(self.np_random)
            else:
                graph = self._graphs[int(self.np_random.integers(len(self._graphs)))]
        if not isinstance(graph, OpGraph):
            raise TypeError(f"ScheduleEnv.reset: the graph must be an OpGraph, got {type(graph).__name__}")
        machine = options.get("machine")
        if machine is None:
            machine = self._machines[0] if len(self._machines) == 1 \
                else self._machines[int(self.np_random.integers(len(self._machines)))]
        if not isinstance(machine, Machine):
            from opsched.specs import load_machine

            machine = load_machine(machine)
        data = self._episode(graph, machine)
        noise = self.np_random.lognormal(0.0, self.noise, data.n).tolist() if self.noise > 0 else None
        self._data = data
        self._ep = Episode(data, noise)
        self._state, self._obs = self._ep.st, self._ep.obs
        self._terminated = False
        self._reference = data.reference
        if self.reference_mode == "measured":
            ref = self._measured_reference.get(data)
            if ref is None:
                seq = uniform_plan(graph, machine, machine.cpu.cores, policy="sequential")
                ref = self._measured_reference[data] = self._measure(seq)["makespan"]
            self._reference = ref
        info = {"graph": graph.name, "machine": machine.name, "n_ops": len(graph.ops),
                "n_slots_used": data.n, "coarsened": not data.coarsening.identity, "reference": self._reference}
        return flatten_obs(self._obs.observe()), info

    @property
    def episode(self) -> Episode:
        """The current episode (simulator state, observation builder, decisions so far)."""
        if self._data is None:
            raise RuntimeError("ScheduleEnv: call reset() before reading episode")
        return self._ep

    @property
    def episode_data(self) -> EpisodeData:
        """The current episode's static data (graph, machine, simulator tables,
        padded features): what observation wrappers derive extra features from."""
        if self._data is None:
            raise RuntimeError("ScheduleEnv: call reset() before reading episode_data")
        return self._data

    def action_masks(self) -> np.ndarray:
        """Boolean mask over the flat action space: True = valid now (sb3-contrib's MaskablePPO reads it)."""
        if self._state is None or self._terminated:
            raise ResetNeeded("ScheduleEnv.action_masks: call reset() first (no episode in progress)")
        return self._obs.action_mask()

    def step(self, action: int | np.integer) -> tuple[dict, float, bool, bool, dict]:
        st = self._state
        if st is None or self._terminated:
            raise ResetNeeded("ScheduleEnv.step: the episode is over (or never began); call reset()")
        a = self._as_index(action)
        t_before = st.now
        if a == self._wait:
            if st.n_running == 0:
                raise InvalidActionError(f"ScheduleEnv.step: 'wait' (action {a}) at t={st.now:.6g}s, but nothing "
                                         "is running to wait for")
            self._ep.advance()
        else:
            slot, rest = divmod(a, MAX_DEVICES * MAX_LEVELS)
            d, lv = divmod(rest, MAX_LEVELS)
            threads = self._threads(slot, d, lv, a)
            why = st.why_not(slot, d, threads)
            if why is not None:
                raise InvalidActionError(f"ScheduleEnv.step: action {a} (start slot {slot} on device {d} with "
                                         f"{threads} threads) is invalid at t={st.now:.6g}s: {why}")
            self._ep.start(slot, d, threads)
        self._ep.settle()
        reward = -(st.now - t_before) / self._reference
        info: dict[str, Any] = {}
        if st.done:
            self._terminated = True
            info = self._final_info()
            if "measured_makespan" in info:
                reward = -(info["measured_makespan"] - t_before) / self._reference
        return flatten_obs(self._obs.observe()), float(reward), st.done, False, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        if self._state is None:
            return "ScheduleEnv: not reset"
        st, data = self._state, self.episode_data
        lines = [f"{data.graph.name} on {data.machine.name}: t={st.now:.6g}s, {st.n_done}/{data.n} done, "
                 f"{st.n_ready} ready, free slots " +
                 ", ".join(f"{d}={f}" for d, f in zip(data.static.dev_ids, st.free, strict=True))]
        for i in st.running_ops():
            lines.append(f"  running {data.static.op_ids[i]} on {data.static.dev_ids[st.device[i]]} "
                         f"x{st.threads[i]}, {st.remaining(i):.3g}s left")
        return "\n".join(lines)

    def close(self) -> None:
        if self._real is not None and not self._shared_real:
            real, self._real = self._real, None
            real.close()

    # -------------------------------------------------------------- internals
    def _as_index(self, action: Any) -> int:
        if type(action) is int or isinstance(action, np.integer):
            a = int(action)
            if 0 <= a < self.layout.n:
                return a
        try:
            arr = np.asarray(action)
            if arr.size != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise TypeError
            a = int(arr.reshape(()))
        except (TypeError, ValueError):
            raise InvalidActionError(f"ScheduleEnv.step: an action is one integer in 0..{self.layout.n - 1}, "
                                     f"got {action!r}") from None
        if not 0 <= a < self.layout.n:
            raise InvalidActionError(f"ScheduleEnv.step: action {a} is outside 0..{self.layout.n - 1}")
        return a

    def _threads(self, slot: int, d: int, lv: int, a: int) -> int:
        data = self.episode_data
        try:
            if slot < data.n:
                return data.static.levels[d][lv]
        except IndexError:
            pass
        if slot >= data.n:
            raise InvalidActionError(f"ScheduleEnv.step: action {a} names op slot {slot}, but the graph has "
                                     f"{data.n} op slots (the rest is padding)")
        if d >= len(data.machine.devices):
            raise InvalidActionError(f"ScheduleEnv.step: action {a} names device {d}; machine "
                                     f"{data.machine.name!r} has {len(data.machine.devices)}")
        levels = data.static.levels[d]
        if lv >= len(levels):
            raise InvalidActionError(f"ScheduleEnv.step: action {a} names thread level {lv} on "
                                     f"{data.static.dev_ids[d]}, which has levels {levels}")
        return int(levels[lv])

    def _final_info(self) -> dict[str, Any]:
        data, st = self.episode_data, self._state
        assert st is not None, "_final_info is only called at the end of an episode"
        meta = {"env": "opsched/Schedule-v0"}
        plan = self._ep.plan("env", meta)
        followed = plan if data.hint_follow is None else episode_plan(data, self._ep, "env", meta)
        trace = st.trace("sim")
        info: dict[str, Any] = {
            "plan": plan, "plan_followed": followed, "trace": trace, "makespan": st.now, "sim_makespan": st.now,
            "reference": self._reference, "lower_bound": data.lower_bound,
            "coarsened": not data.coarsening.identity, "n_ops": len(data.graph.ops),
        }
        if self.backend_name != "sim":
            m = self._measure(followed)
            info.update(makespan=m["makespan"], measured_makespan=m["makespan"], measured_trace=m["trace"],
                        measured_op_times=dict(m["op_times"]))
        return info

    # ------------------------------------------------------------- real mode
    def _measure(self, plan: Plan) -> dict[str, Any]:
        """Run ``plan`` on the real backend: warm-up, repeats, median (cached by plan hash)."""
        data = self.episode_data
        key = _plan_hash(plan)
        hit = self._measured.get(key)
        if hit is not None:
            return hit
        real = self._real
        if self._shared_real and real is not None and real.machine is not data.machine:
            from opsched.engine.sim import cached_fingerprint

            if cached_fingerprint(real.machine) != cached_fingerprint(data.machine):
                raise ValueError(f"ScheduleEnv: the shared {self.backend_name} backend runs plans for machine "
                                 f"{real.machine.name!r}, not for this episode's {data.machine.name!r}")
        elif real is None or real.machine is not data.machine:
            from opsched.backends.registry import get_backend

            self.close()
            real = self._real = get_backend(self.backend_name, data.machine,
                                            **_REAL_OPTIONS.get(self.backend_name, {}))
        for _ in range(self.real_warmup):
            real.run(data.graph, plan)
        traces: list[Trace] = [real.run(data.graph, plan) for _ in range(self.real_repeats)]
        spans = [t.makespan for t in traces]
        median = statistics.median(spans)
        trace = min(traces, key=lambda t: abs(t.makespan - median))
        per_op: dict[str, list[float]] = {}
        for t in traces:
            for e in t.events:
                per_op.setdefault(e.op, []).append(e.duration)
        result = {"makespan": float(median), "trace": trace, "runs": spans,
                  "op_times": {k: float(statistics.median(v)) for k, v in per_op.items()}}
        self._measured[key] = result
        return result


#: Per-backend options in real mode: the env does its own warm-up and repeats, so
#: one TensorFlow call is one traced run (TFBackend's defaults add 2 warm-up, 5
#: timed and 3 traced runs per call).
_REAL_OPTIONS: dict[str, dict[str, Any]] = {"tf": {"warmup": 0, "repeats": 0, "trace_runs": 1}}


def _plan_hash(plan: Plan) -> str:
    body = {"graph": plan.graph_fingerprint, "machine": plan.machine_fingerprint,
            "ops": sorted((k, a.device, a.threads, a.priority, list(a.after)) for k, a in plan.assignments.items())}
    return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()


__all__ = ["InvalidActionError", "MaskedDiscrete", "ScheduleEnv", "MAX_DEVICES", "MAX_LEVELS"]
