"""Expert iteration: the policy's own plans, improved by search in the simulator, become its next targets.

Why: imitating the heuristics caps the policy at their quality, and PPO on
top of that warm start adds nothing measurable (its updates drift away).
Expert iteration (search distillation) keeps what the simulator says is
better instead: every round, for a sample of training pairs,

1. the candidates are the pair's best plan so far (its *target*), the best
   heuristic's plan (the imitation expert), the policy's greedy decoding and
   ``samples`` sampled decodings (numpy, the exported scheduler's own code);
2. the fastest is improved by local search (``search_budget`` simulations:
   thread levels, devices, dispatch order; :mod:`opsched.policies.refine`)
   and kept as the pair's target if it beats the old one;
3. the policy is refit on states labelled with the targets' decisions, from
   episodes the targets play and episodes the policy plays (DAgger), with the
   imitation loss of :mod:`opsched.agents.imitation`.

Targets only ever get faster, so the policy is pulled past its teachers as
far as search finds room.  The trainer evaluates the validation set after
every round and keeps the best round.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th

from opsched.agents.imitation import collect, expert_plan, fit
from opsched.engine.slots import SlotPlan, best_of, from_episode, makespan
from opsched.policies.exported import decode_episode
from opsched.policies.numpy_encoder import NumpyEncoder
from opsched.policies.refine import local_search


@dataclass
class PairTargets:
    """One training pair: its episode data, the best heuristic's plan and the target."""

    graph: Any
    machine: Any
    data: Any
    heuristic: SlotPlan
    target: SlotPlan

    @property
    def gain(self) -> float:
        """Target makespan over the best heuristic's (< 1: search beat the heuristics)."""
        return self.target.makespan / self.heuristic.makespan if self.heuristic.makespan > 0 else 1.0


def numpy_encoder(policy: Any) -> NumpyEncoder:
    """The torch policy's encoder as the exported scheduler runs it (float32 arrays)."""
    enc = policy.features_extractor
    arrays = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in enc.state_dict().items()}
    return NumpyEncoder(arrays, enc.hidden, enc.rounds, 8 if "node_levels" in enc.node_keys else 0)


def policy_candidates(encoder: NumpyEncoder, data: Any, samples: int, temperature: float,
                      rng: np.random.Generator) -> list[SlotPlan]:
    """The policy's greedy decoding and ``samples`` sampled ones, as slot plans."""
    out = [from_episode(decode_episode(encoder, data)[0], "greedy")]
    for k in range(samples):
        out.append(from_episode(decode_episode(encoder, data, rng, temperature)[0], f"sample-{k}"))
    return out


def improve(state: PairTargets, encoder: NumpyEncoder, samples: int, temperature: float, budget: int,
            rng: np.random.Generator) -> str:
    """One expert-iteration step on one pair (steps 1-2 of the module docstring);
    returns where the new target came from (``""``: the old one held)."""
    data = state.data
    cands = [state.target, state.heuristic, *policy_candidates(encoder, data, samples, temperature, rng)]
    start = best_of(data, cands)
    found = local_search(data, start, budget, rng)
    if found.makespan < state.target.makespan * (1.0 - 1e-9):
        state.target = found
        return found.source
    return ""


def expert_iteration(policy: Any, env: Any, pairs: Sequence[tuple[Any, Any]], experts: Sequence[str], *,
                     rounds: int, pairs_per_round: int, samples: int, temperature: float, search_budget: int,
                     steps: int, lr: float, batch_size: int, episodes: int, keep: float, seed: int,
                     model: Any = None, log: Callable[[str], None] = lambda s: None,
                     should_stop: Callable[[], bool] = lambda: False,
                     after_round: Callable[[int, dict[str, float]], None] | None = None,
                     level_weight: float = 0.0,
                     on_step: Callable[[int, int], None] | None = None,
                     teacher: Callable[[Any], SlotPlan] | None = None, resume: Any = None,
                     save: Callable[[Any, np.random.Generator, th.optim.Optimizer], None] | None = None
                     ) -> list[dict[str, float]]:
    """Run ``rounds`` rounds of expert iteration on ``policy`` (see the module
    docstring); ``env`` is a ScheduleEnv over the training pairs (its
    ``max_nodes`` and model make the episodes).  Returns one stats row per round;
    ``after_round(r, stats)`` runs after each (the trainer evaluates there);
    ``on_step(done, total)`` after every pair improved and every fit: progress.
    ``teacher(env)``: a pair's first target (default: the best of ``experts``).
    Resumable between rounds like :func:`opsched.agents.imitation.warm_start`
    (``resume``, ``save``; the targets are part of the saved state)."""
    from opsched.agents.evaluate import policy_actor
    from opsched.agents.rounds import RoundState, restore_optimizer

    saved = resume if resume is not None else RoundState()
    rng = saved.generator(np.random.default_rng([seed, 0xE1]))
    unwrapped = env.unwrapped
    states: dict[int, PairTargets] = {}

    def pair_state(i: int) -> PairTargets:
        state = states.get(i)
        if state is None:
            graph, machine = pairs[i]
            env.reset(options={"graph": graph, "machine": machine})
            data = unwrapped.episode_data  # the slots the env's episodes (and so the labels) use
            heur = teacher(env) if teacher is not None else expert_plan(env, experts, model)
            makespan(data, heur)
            state = states[i] = PairTargets(graph, machine, data, heur, heur.copy())
        return state

    for i, target in saved.targets.items():  # a resumed run's targets so far
        pair_state(i).target = target
        makespan(states[i].data, target)
    demos = saved.demos
    opt = th.optim.Adam(policy.parameters(), lr=lr)
    restore_optimizer(opt, saved)
    history = saved.history
    per_round = min(pairs_per_round, len(pairs))
    total_steps = rounds * (per_round + 1)
    done_steps = saved.next_round * (per_round + 1)
    for r in range(saved.next_round, rounds):
        if should_stop():
            break
        t0 = time.time()
        for group in opt.param_groups:  # decays to lr/10 over the rounds, as the warm start's
            group["lr"] = lr * 0.1 ** (r / max(rounds - 1, 1))
        encoder = numpy_encoder(policy)
        picked = [int(i) for i in rng.choice(len(pairs), size=per_round, replace=False)]
        chosen = [pairs[i] for i in picked]
        sources: dict[str, int] = {}
        for i in picked:
            if should_stop():
                break
            src = improve(pair_state(i), encoder, samples, temperature, search_budget, rng)
            if src:  # e.g. "search(sample-1)" -> "search(sample)"
                kind = re.sub(r"-\d+", "", src)
                sources[kind] = sources.get(kind, 0) + 1
            done_steps += 1
            if on_step is not None:
                on_step(done_steps, total_steps)
        targets = {(id(s.graph), id(s.machine)): s.target for s in states.values()}
        play = [chosen[i] for i in rng.choice(len(chosen), size=min(episodes, len(chosen)), replace=False)]
        half = len(play) // 2
        rets = collect(env, play[:half], experts, demos, None, model, targets, should_stop, keep, rng)
        rets += collect(env, play[half:], experts, demos, policy_actor(policy), model, targets, should_stop,
                        keep, rng)
        stats = fit(policy, demos, steps, lr, batch_size, seed + 100 + r, should_stop, opt, level_weight)
        done_steps += 1
        if on_step is not None:
            on_step(done_steps, total_steps)
        gains = [s.gain for s in states.values()]
        stats.update(round=r, samples=len(demos), pairs=len(states),
                     target_gain_gmean=float(np.exp(np.mean(np.log(gains)))) if gains else float("nan"),
                     improved=float(sum(sources.values())), played_return=float(np.mean(rets)) if rets else float("nan"),
                     seconds=time.time() - t0)
        if should_stop():
            break  # an unfinished round: played again on resume
        history.append(stats)
        log(f"expert iteration round {r}: {stats['improved']:.0f} of {len(chosen)} targets improved "
            f"({', '.join(f'{k} {v}' for k, v in sorted(sources.items())) or 'none'}); targets x"
            f"{stats['target_gain_gmean']:.3f} of the best heuristic (geo-mean over {len(states)} pairs); "
            f"fit accuracy {stats['accuracy']:.3f}")
        if after_round is not None:
            after_round(r, stats)
        if should_stop():
            history.pop()
            break
        saved.next_round = r + 1
        saved.targets = {i: s.target for i, s in states.items()}
        if save is not None:
            save(saved, rng, opt)
    return history


__all__ = ["PairTargets", "expert_iteration", "improve", "numpy_encoder", "policy_candidates"]
