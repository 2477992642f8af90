"""The state of a round-based warm-start phase (imitation, expert iteration), saved between rounds.

Why: a Ctrl-C during the warm start used to leave a step-0 checkpoint of a
half-trained policy, and ``--resume`` then skipped the warm start, went
straight to PPO's zero steps and exported that policy.  Now each finished
round (collected, fitted, evaluated) saves everything the next round reads,
and ``--resume`` starts at the first unfinished round; an interrupted round
is played again from the state before it, so the resumed run computes
exactly what the uninterrupted one would have.

What a round reads, and where it is kept (``<run>/warm_start/<phase>/``):

=====================  ==============================================================
``state.json``         the next round, the phase's random generator, each round's
                       statistics, the best round so far, the evaluations written,
                       the Adam optimizer's hyperparameters, expert iteration's
                       targets (slot plans)
``demos_<r>.npz``      the demonstrations round ``r`` added (states, masks, labels,
                       returns-to-go), compressed; the fit samples from all of them
``optimizer.npz``      the Adam moments and step counts (numpy arrays)
``../round_<k>.zip``   the policy after round ``k`` (the learning curve's models)
=====================  ==============================================================

No pickles: JSON and ``.npz`` read with ``allow_pickle=False``.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch as th

from opsched.agents.demos import STATIC_KEYS, STEP_KEYS, Demonstrations
from opsched.engine.slots import SlotPlan
from opsched.io import atomic_write_bytes, atomic_write_text

STATE_FILE = "state.json"


@dataclass
class RoundState:
    """What round ``next_round`` of a phase starts from."""

    next_round: int = 0
    rng: dict[str, Any] | None = None            # the phase generator's bit_generator.state
    history: list[dict[str, float]] = field(default_factory=list)
    best_round: int | None = None
    evaluations: int = 0                         # rows of evaluations.csv when the state was saved
    targets: dict[int, SlotPlan] = field(default_factory=dict)   # expert iteration: pair index -> target
    demos: Demonstrations = field(default_factory=Demonstrations)
    demo_rounds: list[tuple[int, int]] = field(default_factory=list)  # (episodes, steps) at the end of each round
    optimizer: dict[str, Any] | None = None      # torch Adam state_dict
    extra: dict[str, Any] = field(default_factory=dict)        # the trainer's own (best score so far)

    def generator(self, default: np.random.Generator) -> np.random.Generator:
        """The phase's generator as saved (or ``default`` for a fresh phase)."""
        if self.rng is None:
            return default
        gen = np.random.Generator(getattr(np.random, self.rng["bit_generator"])())
        gen.bit_generator.state = self.rng
        return gen


def save(folder: Path, state: RoundState, rng: np.random.Generator, optimizer: th.optim.Optimizer) -> None:
    """Write ``state`` (after a finished round) into ``folder``: the new
    demonstrations, the optimizer, then ``state.json`` last (its presence marks a
    complete save)."""
    folder.mkdir(parents=True, exist_ok=True)
    demos = state.demos
    start_ep, start_step = state.demo_rounds[-1] if state.demo_rounds else (0, 0)
    r = len(state.demo_rounds)
    _save_npz(folder / f"demos_{r}.npz", _demo_arrays(demos, start_ep, start_step), compressed=True)
    state.demo_rounds.append((len(demos.episodes), len(demos.actions)))
    opt_state = optimizer.state_dict()
    arrays: dict[str, np.ndarray] = {}
    for idx, per in opt_state["state"].items():
        for name, value in per.items():
            arrays[f"{idx}/{name}"] = value.detach().cpu().numpy() if isinstance(value, th.Tensor) else np.asarray(value)
    _save_npz(folder / "optimizer.npz", arrays, compressed=False)
    body = {
        "next_round": state.next_round, "rng": rng.bit_generator.state, "history": state.history,
        "best_round": state.best_round, "evaluations": state.evaluations, "demo_rounds": state.demo_rounds,
        "param_groups": opt_state["param_groups"],
        "targets": {str(k): _plan_json(sp) for k, sp in state.targets.items()}, "extra": state.extra,
    }
    atomic_write_text(folder / STATE_FILE, json.dumps(body, default=float) + "\n")


def load(folder: Path) -> RoundState | None:
    """The state saved in ``folder`` (None: the phase never finished a round)."""
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    body = json.loads(path.read_text())
    state = RoundState(next_round=int(body["next_round"]), rng=body["rng"], history=list(body["history"]),
                       best_round=body.get("best_round"), evaluations=int(body.get("evaluations", 0)),
                       targets={int(k): _plan_from(v) for k, v in body.get("targets", {}).items()},
                       demo_rounds=[tuple(x) for x in body["demo_rounds"]], extra=dict(body.get("extra", {})))
    for r in range(len(state.demo_rounds)):
        _load_demos(folder / f"demos_{r}.npz", state.demos)
    with np.load(folder / "optimizer.npz", allow_pickle=False) as npz:
        per: dict[int, dict[str, th.Tensor]] = {}
        for key in npz.files:
            idx, name = key.split("/", 1)
            per.setdefault(int(idx), {})[name] = th.as_tensor(npz[key].copy())
    state.optimizer = {"state": per, "param_groups": body["param_groups"]}
    return state


def restore_optimizer(optimizer: th.optim.Optimizer, state: RoundState) -> None:
    if state.optimizer is not None:
        optimizer.load_state_dict(state.optimizer)


# ---------------------------------------------------------------- internals
def _demo_arrays(d: Demonstrations, start_ep: int, start_step: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    episodes = d.episodes[start_ep:]
    for k in STATIC_KEYS:
        if episodes and k in episodes[0]:
            out[f"episode/{k}"] = np.stack([e[k] for e in episodes])
    n = len(d.actions) - start_step
    for k in STEP_KEYS:
        if n:
            out[f"step/{k}"] = np.stack(d.steps[k][start_step:])
    if n:
        out["masks"] = np.stack(d.masks[start_step:])
    out["episode_of"] = np.asarray(d.episode_of[start_step:], np.int64)
    out["actions"] = np.asarray(d.actions[start_step:], np.int64)
    out["returns"] = np.asarray(d.returns[start_step:], np.float64)
    out["n_episodes"] = np.asarray(len(episodes), np.int64)
    return out


def _load_demos(path: Path, d: Demonstrations) -> None:
    with np.load(path, allow_pickle=False) as npz:
        n_eps = int(npz["n_episodes"])
        statics = {k: npz[f"episode/{k}"] for k in STATIC_KEYS if f"episode/{k}" in npz.files}
        for e in range(n_eps):
            d.episodes.append({k: v[e] for k, v in statics.items()})
        n = len(npz["actions"])
        for k in STEP_KEYS:
            if n:
                d.steps[k].extend(list(npz[f"step/{k}"]))
        if n:
            d.masks.extend(list(npz["masks"]))
        d.episode_of.extend(int(x) for x in npz["episode_of"])
        d.actions.extend(int(x) for x in npz["actions"])
        d.returns.extend(float(x) for x in npz["returns"])


def _save_npz(path: Path, arrays: dict[str, np.ndarray], compressed: bool) -> None:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, allow_pickle=False, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def _plan_json(sp: SlotPlan) -> dict[str, Any]:
    return {"device": list(sp.device), "level": list(sp.level), "rank": list(sp.rank),
            "after": [list(a) for a in sp.after], "source": sp.source, "makespan": float(sp.makespan)}


def _plan_from(body: dict[str, Any]) -> SlotPlan:
    return SlotPlan([int(x) for x in body["device"]], [int(x) for x in body["level"]],
                    [int(x) for x in body["rank"]], [tuple(int(y) for y in a) for a in body["after"]],
                    str(body["source"]), float(body["makespan"]))


__all__ = ["RoundState", "load", "restore_optimizer", "save"]
