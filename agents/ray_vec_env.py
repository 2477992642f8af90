"""``RayVecEnv``: an SB3 ``VecEnv`` whose environments live in Ray actors spread over a cluster.

The learner (MaskablePPO) stays on the driver; each :class:`EnvWorker` actor
holds ``envs_per_worker`` monitored ScheduleEnvs and steps them all in one
call, the way ``SubprocVecEnv``'s worker steps its one env:

* **one round trip per step**: a worker's reply carries the observations,
  rewards, dones, the infos and the *next* action masks, so MaskablePPO's
  ``env_method("action_masks")`` is answered from the driver's copy (a
  ``SubprocVecEnv`` pays a second round trip for it);
* **same seed, same run**: env ``i`` gets ``seed + i`` at the first reset
  and resets itself at episode ends exactly as ``SubprocVecEnv``'s worker
  does, and observations arrive bit for bit (:mod:`opsched.agents.wire`), so
  a cluster run equals a local run with the same seed;
* **plain data only**: the driver sends the env description as JSON
  (graphs, machines, planning-model files: :func:`env_spec`) and actions as
  integers; a worker answers with :func:`~opsched.agents.wire.pack_arrays`
  bytes and JSON-able infos: of each observation only the arrays that changed
  since the last one (the graph's arrays are fixed for an episode: 27 of a
  128-slot observation's 32 KB), the masks as bits;
* **a lost worker** (its process or its node died): Ray restarts the actor
  (``max_restarts``; on another node when its node is gone), or, once Ray
  gives it up, the driver creates a new one.  Its envs' episodes in flight
  are cut: the step reports them done and truncated
  (``TimeLimit.truncated``, the last observation as ``terminal_observation``,
  ``worker_restarted`` in the info), so PPO bootstraps them from the value
  function, and training goes on from a fresh reset.  Nothing else is lost:
  the learner, its rollout buffer and its checkpoints live on the driver.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from stable_baselines3.common.vec_env import VecEnv
from stable_baselines3.common.vec_env.base_vec_env import VecEnvIndices, VecEnvObs, VecEnvStepReturn

if TYPE_CHECKING:
    import gymnasium as gym

from opsched.agents.cluster import ClusterError, check_versions, machine_resource, process_record
from opsched.agents.wire import WireError, info_from_wire, info_to_wire, pack_arrays, unpack_arrays

ENV_SPEC_FORMAT = "opsched.env-spec"
#: Seconds to wait for the workers to start (placing, importing opsched, building the envs).
START_TIMEOUT_S = 300.0
#: Calls to a lost worker before it is given up (the first half wait for Ray's own restart).
RECOVER_TRIES = 6
#: env_method calls whose effect outlives the call: a restarted worker gets them again
STICKY_METHODS = frozenset({"set_pairs"})
_RNG = "__bit_generator_state__"


# ------------------------------------------------------------------ env spec
def env_spec(graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int, backend: str = "sim",
             graph_specs: Sequence[str] | None = None, model_files: dict[str, str] | None = None,
             focus: dict[str, Any] | None = None, hint_plan: bool = True) -> dict[str, Any]:
    """What a worker needs to build the driver's environments, as JSON-able data.

    In the simulator the graphs travel as graph JSON; a real backend executes
    them, so each node imports them from their spec strings (``graph_specs``)
    and checks the fingerprints.  ``model_files``: planning-model files of the
    profile cache (path -> JSON text) when training on profiled machines
    (:mod:`opsched.agents.profiled`).  ``focus``: the arguments of
    :class:`~opsched.agents.focus.FocusPairs`, which then wraps every env (the
    RL phase's pairs, set later with ``env_method("set_pairs", ...)``).  ``hint_plan``: the
    run's ``hint_observation`` (absent from a spec: True)."""
    spec: dict[str, Any] = {
        "format": ENV_SPEC_FORMAT, "version": 1, "backend": backend, "max_nodes": int(max_nodes),
        "graph_fingerprints": [g.fingerprint() for g in graphs],
        "machines": [m.to_dict() for m in machines], "machine_fingerprints": [m.fingerprint() for m in machines],
    }
    if backend == "sim":
        spec["graphs"] = [g.to_dict() for g in graphs]
    else:
        if graph_specs is None or len(graph_specs) != len(graphs):
            raise ClusterError("a real backend's workers import the graphs themselves: give their spec strings")
        spec["graph_specs"] = list(graph_specs)
    if model_files:
        spec["model_files"] = dict(model_files)
    if not hint_plan:
        spec["hint_plan"] = False
    if focus is not None:
        spec["focus"] = {"shaping": bool(focus.get("shaping", False)), "seed": int(focus.get("seed", 0)),
                         "teacher": dict(focus.get("teacher") or {})}
    return spec


def build_envs(spec: dict[str, Any], n: int, where: str = "the driver") -> list[Any]:
    """``n`` monitored ScheduleEnvs from an :func:`env_spec` (fingerprints checked)."""
    from stable_baselines3.common.monitor import Monitor

    from opsched.agents.environments import make_env
    from opsched.graph import OpGraph
    from opsched.machine import Machine

    if not isinstance(spec, dict) or spec.get("format") != ENV_SPEC_FORMAT or spec.get("version") != 1:
        raise WireError(f"env spec from {where}: not an opsched env spec (version 1)")
    backend = str(spec["backend"])
    if backend == "sim":
        graphs = [OpGraph.from_dict(g, where=f"env spec from {where}") for g in spec["graphs"]]
    else:
        from opsched.specs import load_graph

        graphs = [load_graph(s) for s in spec["graph_specs"]]
    for g, fp in zip(graphs, spec["graph_fingerprints"]):
        if g.fingerprint() != fp:
            raise ClusterError(f"graph {g.name!r} differs on this node (fingerprint {g.fingerprint()}, the driver's "
                               f"{fp}): install the same opsched and model code on every node")
    machines = [Machine.from_dict(m, where=f"env spec from {where}") for m in spec["machines"]]
    for m, fp in zip(machines, spec["machine_fingerprints"]):
        if m.fingerprint() != fp:
            raise WireError(f"env spec from {where}: machine {m.name!r} does not match its fingerprint")
    max_nodes = int(spec["max_nodes"])
    hint_plan = spec.get("hint_plan", True) is not False
    if spec.get("model_files"):
        from opsched.agents.profiled import make_profiled_env, models_from_files

        models = models_from_files(spec["model_files"], machines, where=where)
        make = lambda: make_profiled_env(graphs, machines, max_nodes, models, hint_plan)  # noqa: E731
    else:
        make = lambda: make_env(graphs, machines, max_nodes, backend=backend, hint_plan=hint_plan)  # noqa: E731
    focus = spec.get("focus")
    if isinstance(focus, dict):  # the RL phase's pairs (opsched.agents.focus), as the local workers
        from opsched.agents.focus import FocusPairs

        plain = make
        make = lambda: FocusPairs(plain(), **focus)  # noqa: E731
    return [Monitor(make(), info_keywords=("makespan",)) for _ in range(n)]


# -------------------------------------------------------------------- worker
class EnvWorker:
    """A Ray actor's body: ``n`` envs of one :func:`env_spec`, stepped together.

    ``machine``: the fingerprint this worker must run on (real execution); the
    node's own probe is checked against it."""

    def __init__(self, spec_json: str, n: int, machine: str | None = None) -> None:
        if machine is not None:
            from opsched.machine import Machine

            here = Machine.probe().fingerprint()
            if here != machine:
                raise ClusterError(f"worker placed on machine {here}, but its rollouts are for machine {machine} "
                                   f"(the node advertises {machine_resource(machine)} wrongly)")
        self.envs = build_envs(json.loads(spec_json), int(n))
        self.record = process_record()
        self._sent: list[dict[str, np.ndarray]] = [{} for _ in self.envs]  # what the driver holds, per env

    def describe(self) -> dict[str, Any]:
        return self.record

    def _mask(self, env: Any) -> np.ndarray:
        return np.asarray(env.get_wrapper_attr("action_masks")(), dtype=bool)

    def _encode(self, obs: list[dict[str, np.ndarray]], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """Each env's observation arrays that changed since the last one sent (most of an observation,
        the graph's, is fixed for the episode), and the masks packed to bits."""
        for i, o in enumerate(obs):
            last = self._sent[i]
            for k, v in o.items():
                if k not in last or not np.array_equal(last[k], v):
                    arrays[f"o{i}.{k}"] = v
                    last[k] = np.array(v, copy=True)
        masks = np.stack([self._mask(e) for e in self.envs])
        arrays["masks"] = np.packbits(masks, axis=1)
        return {"mask_len": int(masks.shape[1])}

    def reset(self, seeds: list[int | None], options: list[dict]) -> bytes:
        obs, infos = [], []
        for env, seed, opts in zip(self.envs, seeds, options):
            o, info = env.reset(seed=seed, **({"options": opts} if opts else {}))
            obs.append(o)
            infos.append(info_to_wire(info))
        arrays: dict[str, np.ndarray] = {}
        meta = self._encode(obs, arrays)
        return pack_arrays(arrays, {"reset_infos": infos, **meta})

    def step(self, actions: list[int]) -> bytes:
        """Step every env (resetting those whose episode ended, as SB3's subprocess worker does)."""
        obs, rewards, dones, infos, reset_infos = [], [], [], [], []
        arrays: dict[str, np.ndarray] = {}
        for i, (env, action) in enumerate(zip(self.envs, actions)):
            o, reward, terminated, truncated, info = env.step(int(action))
            done = terminated or truncated
            info["TimeLimit.truncated"] = truncated and not terminated
            reset_info: dict = {}
            if done:
                arrays.update({f"term{i}.{k}": v for k, v in o.items()})
                o, reset_info = env.reset()
            obs.append(o)
            rewards.append(reward)
            dones.append(done)
            infos.append(info_to_wire(info))
            reset_infos.append(info_to_wire(reset_info))
        meta = self._encode(obs, arrays)
        arrays.update(rewards=np.asarray(rewards, dtype=np.float64), dones=np.asarray(dones, dtype=bool))
        return pack_arrays(arrays, {"infos": infos, "reset_infos": reset_infos, **meta})

    def get_attr(self, name: str, indices: list[int]) -> list[Any]:
        out = []
        for i in indices:
            value = self.envs[i].get_wrapper_attr(name)
            if name == "np_random":
                out.append({_RNG: value.bit_generator.state})
                continue
            plain = info_to_wire({name: value})
            if name not in plain:
                raise ClusterError(f"env attribute {name!r} ({type(value).__name__}) has no plain-data form to "
                                   "send to the driver")
            out.append(plain[name])
        return out

    def has_attr(self, name: str) -> bool:
        try:
            self.envs[0].get_wrapper_attr(name)
        except AttributeError:
            return False
        return True

    def set_attr(self, name: str, values: list[Any], indices: list[int]) -> None:
        for i, value in zip(indices, values):
            if isinstance(value, dict) and set(value) == {_RNG}:
                value = _generator(value[_RNG])
            setattr(self.envs[i], name, value)

    def env_method(self, name: str, args: list, kwargs: dict, indices: list[int]) -> list[Any]:
        return [info_to_wire({"r": self.envs[i].get_wrapper_attr(name)(*args, **kwargs)}).get("r") for i in indices]

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _generator(state: dict[str, Any]) -> np.random.Generator:
    gen = np.random.Generator(getattr(np.random, str(state["bit_generator"]))())
    gen.bit_generator.state = state
    return gen


_ACTOR: Any = None


def _actor_class(ray: Any) -> Any:
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = ray.remote(EnvWorker)
    return _ACTOR


# ------------------------------------------------------------------- VecEnv
@dataclass
class _Worker:
    index: int
    lo: int
    hi: int
    options: dict[str, Any]
    machine: str | None
    spec_json: str
    actor: Any = None
    record: dict[str, Any] = field(default_factory=dict)


class RayVecEnv(VecEnv):
    """``n_envs`` environments in ``ceil(n_envs / envs_per_worker)`` Ray actors (see the module docstring).

    ``spec``: :func:`env_spec` (or one per worker); ``observation_space`` / ``action_space``: the
    envs' (taken from a driver-side env: spaces never cross the wire);
    ``machines``: per worker, the machine fingerprint it must run on (its
    custom resource, one unit), or None; ``max_restarts``: Ray's restarts per
    actor, and the lost workers the run survives in all; ``on_change(self)``:
    called after the workers start and after each recovery (the run folder's
    ``cluster.json``)."""

    def __init__(self, ray: Any, spec: dict[str, Any] | list[dict[str, Any]], n_envs: int, observation_space: Any, action_space: Any,
                 envs_per_worker: int = 1, machines: Sequence[str | None] | None = None, max_restarts: int = 3,
                 on_change: Callable[[RayVecEnv], None] | None = None) -> None:
        self.ray = ray
        self.max_restarts = int(max_restarts)
        self.on_change = on_change
        self.restarts = 0
        self.events: list[dict[str, Any]] = []
        self.steps = 0
        per = max(1, int(envs_per_worker))
        bounds = [(lo, min(lo + per, n_envs)) for lo in range(0, n_envs, per)]
        machines = list(machines) if machines is not None else [None] * len(bounds)
        if len(machines) != len(bounds):
            raise ClusterError(f"{len(machines)} machines named for {len(bounds)} workers")
        specs = [json.dumps(s) for s in spec] if isinstance(spec, list) else [json.dumps(spec)] * len(bounds)
        if len(specs) != len(bounds):
            raise ClusterError(f"{len(specs)} env specs given for {len(bounds)} workers")
        self.workers = []
        for k, ((lo, hi), fp) in enumerate(zip(bounds, machines)):
            opts: dict[str, Any] = {"num_cpus": 1, "max_restarts": self.max_restarts, "max_task_retries": 0}
            if fp is not None:
                opts["resources"] = {machine_resource(fp): 1.0}
            else:
                opts["scheduling_strategy"] = "SPREAD"
            self.workers.append(_Worker(k, lo, hi, opts, fp, specs[k]))
        self._driver = process_record()
        for w in self.workers:
            w.actor = self._start(w)
        self._describe_all()
        self._masks: list[np.ndarray] = []
        self._last_obs: list[dict[str, np.ndarray]] = [{} for _ in range(n_envs)]
        self._pending: list[Any] | None = None
        self._base_seed = 0
        #: env_method calls that set state a restarted worker must get again (FocusPairs.set_pairs)
        self._sticky: list[tuple[str, list, dict, list[int]]] = []
        super().__init__(n_envs, observation_space, action_space)
        if self.on_change is not None:
            self.on_change(self)

    # ------------------------------------------------------------- workers
    def _start(self, w: _Worker) -> Any:
        return _actor_class(self.ray).options(**w.options).remote(w.spec_json, w.hi - w.lo, w.machine)

    def _describe_all(self) -> None:
        refs = [w.actor.describe.remote() for w in self.workers]
        try:
            records = self.ray.get(refs, timeout=START_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the env workers did not start within {START_TIMEOUT_S:.0f} s: the cluster lacks "
                               "free CPUs (one per worker) or a node offering the machine a worker is for") from None
        except self.ray.exceptions.RayTaskError as exc:
            raise ClusterError(f"an env worker failed to start: {_first_line(exc)}") from None
        for w, rec in zip(self.workers, records):
            check_versions(self._driver, rec)
            w.record = rec

    def describe(self) -> dict[str, Any]:
        """The workers (node, pid, envs), the restarts and the recovery events, for the run folder."""
        return {"workers": [{"worker": w.index, "envs": list(range(w.lo, w.hi)), "machine": w.machine,
                             **w.record} for w in self.workers],
                "restarts": self.restarts, "events": list(self.events)}

    def _recover(self, w: _Worker, exc: BaseException) -> tuple[dict[str, np.ndarray], Any]:
        """A lost worker: Ray's restart (or a new actor), fresh resets of its envs."""
        self.restarts += 1
        event = {"worker": w.index, "step": self.steps, "node_before": w.record.get("node_ip"),
                 "pid_before": w.record.get("pid"), "error": _first_line(exc), "at": time.time()}
        if self.restarts > self.max_restarts:
            raise ClusterError(f"env worker {w.index} lost ({_first_line(exc)}), and {self.restarts - 1} workers were "
                               f"lost before: giving up (max_restarts={self.max_restarts})") from None
        seeds = [int(np.random.SeedSequence([self._base_seed, i, self.restarts]).generate_state(1)[0])
                 for i in range(w.lo, w.hi)]
        errors = self.ray.exceptions
        blob = None
        for attempt in range(RECOVER_TRIES):
            try:
                self._replay(w)
                blob = self.ray.get(w.actor.reset.remote(seeds, [{}] * (w.hi - w.lo)), timeout=START_TIMEOUT_S)
                w.record = self.ray.get(w.actor.describe.remote(), timeout=START_TIMEOUT_S)
                break
            except errors.ActorUnavailableError:  # Ray may be restarting it: wait a moment, then replace it
                if attempt < RECOVER_TRIES // 2:
                    time.sleep(1.0)
                    continue
                self._replace(w)
            except (errors.RayActorError, errors.GetTimeoutError):  # given up by Ray: a new actor
                self._replace(w)
        if blob is None:
            raise ClusterError(f"env worker {w.index} could not be restarted: {_first_line(exc)}") from None
        event.update(node_after=w.record.get("node_ip"), pid_after=w.record.get("pid"))
        self.events.append(event)
        if self.on_change is not None:
            self.on_change(self)
        return unpack_arrays(blob, f"env worker {w.index}")

    def _replay(self, w: _Worker) -> None:
        """The sticky env_method calls (:attr:`STICKY_METHODS`) again on ``w``'s envs, in order."""
        for name, args, kwargs, indices in self._sticky:
            local = [i - w.lo for i in indices if w.lo <= i < w.hi]
            if local:
                self.ray.get(w.actor.env_method.remote(name, args, kwargs, local), timeout=START_TIMEOUT_S)

    def _replace(self, w: _Worker) -> None:
        try:
            self.ray.kill(w.actor, no_restart=True)
        except Exception:  # already gone
            pass
        w.actor = self._start(w)

    # ----------------------------------------------------------------- API
    def seed(self, seed: int | None = None) -> Sequence[int | None]:
        seeds = super().seed(seed)
        first = seeds[0]  # VecEnv.seed draws one when seed is None: never None here
        self._base_seed = int(first) if first is not None else 0
        return seeds

    def reset(self) -> VecEnvObs:
        refs = [w.actor.reset.remote(self._seeds[w.lo:w.hi], self._options[w.lo:w.hi]) for w in self.workers]
        obs: list[dict[str, np.ndarray]] = []
        masks, self.reset_infos = [], []
        for w, ref in zip(self.workers, refs):
            try:
                arrays, meta = unpack_arrays(self.ray.get(ref), f"env worker {w.index}")
            except self.ray.exceptions.RayActorError as exc:
                arrays, meta = self._recover(w, exc)
            obs += self._decode(w, arrays)
            masks += _masks(arrays, meta)
            self.reset_infos += [info_from_wire(i) for i in meta["reset_infos"]]
        self._masks, self._last_obs = masks, obs
        self._reset_seeds()
        self._reset_options()
        return _stack(obs)

    def step_async(self, actions: np.ndarray) -> None:
        acts = [int(a) for a in np.asarray(actions).reshape(self.num_envs)]
        self._pending = [w.actor.step.remote(acts[w.lo:w.hi]) for w in self.workers]

    def step_wait(self) -> VecEnvStepReturn:
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("RayVecEnv.step_wait without step_async")
        obs: list[dict[str, np.ndarray]] = []
        rewards, dones, infos, masks, reset_infos = [], [], [], [], []
        for w, ref in zip(self.workers, pending):
            n = w.hi - w.lo
            try:
                arrays, meta = unpack_arrays(self.ray.get(ref), f"env worker {w.index}")
                part_infos = [info_from_wire(i, f"env worker {w.index}") for i in meta["infos"]]
                for j, info in enumerate(part_infos):
                    if arrays["dones"][j]:
                        info["terminal_observation"] = {k[len(f"term{j}."):]: v for k, v in arrays.items()
                                                        if k.startswith(f"term{j}.")}
                rewards += [float(r) for r in arrays["rewards"]]
                dones += [bool(d) for d in arrays["dones"]]
                reset_infos += [info_from_wire(i) for i in meta["reset_infos"]]
            except self.ray.exceptions.RayActorError as exc:
                arrays, meta = self._recover(w, exc)
                part_infos = [{"TimeLimit.truncated": True, "terminal_observation": self._last_obs[i],
                               "worker_restarted": True} for i in range(w.lo, w.hi)]
                rewards += [0.0] * n
                dones += [True] * n
                reset_infos += [info_from_wire(i) for i in meta["reset_infos"]]
            obs += self._decode(w, arrays)
            masks += _masks(arrays, meta)
            infos += part_infos
        self._masks, self._last_obs, self.reset_infos = masks, obs, reset_infos
        self.steps += self.num_envs
        return _stack(obs), np.asarray(rewards, dtype=np.float64), np.asarray(dones, dtype=bool), infos

    def close(self) -> None:
        for w in self.workers:
            try:
                self.ray.get(w.actor.close.remote(), timeout=30)
            except Exception:  # a worker already gone has nothing left to close
                pass
            self.ray.kill(w.actor, no_restart=True)
        self.workers = []

    def _decode(self, w: _Worker, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Worker ``w``'s observations: the arrays it sent, the others as they were (see ``EnvWorker._encode``)."""
        out = []
        for j in range(w.hi - w.lo):
            last = self._last_obs[w.lo + j]
            obs = {}
            for k in cast("gym.spaces.Dict", self.observation_space).spaces:
                got = arrays.get(f"o{j}.{k}")
                if got is None:
                    if k not in last:
                        raise WireError(f"env worker {w.index}: observation {k!r} of env {w.lo + j} never sent")
                    got = last[k]
                obs[k] = got
            out.append(obs)
        return out

    def _where(self, indices: VecEnvIndices) -> list[tuple[_Worker, list[int]]]:
        """Per worker, the local indices of ``indices`` it holds (in order)."""
        out = []
        for w in self.workers:
            local = [i - w.lo for i in self._get_indices(indices) if w.lo <= i < w.hi]
            if local:
                out.append((w, local))
        return out

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        if attr_name == "render_mode":
            return [None for _ in self._get_indices(indices)]
        out = []
        for w, local in self._where(indices):
            for value in self.ray.get(w.actor.get_attr.remote(attr_name, local)):
                out.append(_generator(value[_RNG]) if isinstance(value, dict) and set(value) == {_RNG} else value)
        return out

    def has_attr(self, attr_name: str) -> bool:
        return bool(self.ray.get(self.workers[0].actor.has_attr.remote(attr_name)))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        plain = {_RNG: value.bit_generator.state} if isinstance(value, np.random.Generator) else value
        self.ray.get([w.actor.set_attr.remote(attr_name, [plain] * len(local), local)
                      for w, local in self._where(indices)])

    def env_method(self, method_name: str, *method_args: Any, indices: VecEnvIndices = None,
                   **method_kwargs: Any) -> list[Any]:
        if method_name == "action_masks":  # sent with every step's reply
            return [self._masks[i] for i in self._get_indices(indices)]
        if method_name in STICKY_METHODS:
            self._sticky.append((method_name, list(method_args), dict(method_kwargs),
                                 list(self._get_indices(indices))))
        out = []
        for w, local in self._where(indices):
            out += self.ray.get(w.actor.env_method.remote(method_name, list(method_args), method_kwargs, local))
        return out

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        from stable_baselines3.common.monitor import Monitor

        return [issubclass(Monitor, wrapper_class) for _ in self._get_indices(indices)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        return [None for _ in range(self.num_envs)]


def _masks(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> list[np.ndarray]:
    return list(np.unpackbits(arrays["masks"], axis=1, count=int(meta["mask_len"])).astype(bool))


def _stack(obs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([o[k] for o in obs]) for k in obs[0]}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
