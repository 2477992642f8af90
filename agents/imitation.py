"""Imitation warm start: behaviour cloning (DAgger) from the heuristics, before PPO.

Why: PPO from a random policy spends most of a 15-minute budget rediscovering
list scheduling.  The heuristic baselines already encode it, so the policy
first learns to *act like the best heuristic of each training pair* and PPO
then only has to improve on that.  Plain torch on the policy's own
parameters; the SB3 algorithm is untouched.

The expert.  For a (graph, machine) pair, every heuristic in ``experts`` plans
the original graph and the fastest Plan in the simulator is kept.  A Plan is
turned into env decisions with the Plan's own execution semantics
(``opsched.plan``): at a decision point, among the ready op slots whose
``after`` slots are done, in descending priority, start the first one whose
(device, threads) is valid now; if none is, wait.  That replays the Plan's
list schedule decision by decision, and it is defined in *any* state, which is
what DAgger needs: rounds after the first let the learner act (greedy) and
label the states it reaches with the expert's choice.  On a coarsened graph a
group takes the assignment of its highest-priority member.

Loss: cross-entropy of the masked logits against the expert action, plus
(``imitation_level_weight``, default 0) the cross-entropy of the (device,
thread level) marginal (:func:`level_loss`), plus ``0.5 *`` the squared error of the value head against the return-to-go of
the episode actually played (so PPO starts with a critic of the right scale).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch as th

from opsched.agents.demos import STATIC_KEYS, STEP_KEYS, Demonstrations
from opsched.engine.layout import MAX_DEVICES, MAX_LEVELS
from opsched.engine.sim import DONE
from opsched.engine.slots import SlotPlan, from_plan

#: A target over the env's op slots: device, thread level, dispatch rank and holds per slot.
ExpertPlan = SlotPlan


def best_expert(graph: Any, machine: Any, experts: Sequence[str], model: Any = None) -> tuple[str, Any, float]:
    """(name, Plan, makespan) of the fastest heuristic on ``graph`` in the simulator."""
    from opsched.policies.hints import best_heuristic

    return best_heuristic(graph, machine, model, tuple(experts))


def expert_plan(env: Any, experts: Sequence[str], model: Any = None) -> SlotPlan:
    """The best heuristic's Plan for the env's current episode, mapped to op slots."""
    data = env.unwrapped.episode_data
    name, plan, makespan = best_expert(data.graph, data.machine, experts, model)
    target = from_plan(data, plan, f"heuristic:{name}")
    if data.coarsening.identity:
        target.makespan = makespan  # else: simulated on the coarse graph when needed (refine.makespan)
    return target


def expert_action(env: Any, ep: ExpertPlan, mask: np.ndarray) -> int:
    """The expert's decision in the env's current state (see the module docstring)."""
    episode, layout = env.unwrapped.episode, env.unwrapped.layout
    status = episode.status
    for slot in sorted(episode.ready_ops(), key=ep.rank.__getitem__):
        if any(status[j] != DONE for j in ep.after[slot]):
            continue
        a = layout.encode(slot, ep.device[slot], ep.level[slot])
        if mask[a]:
            return a
    if mask[layout.wait]:
        return layout.wait
    # Nothing of the plan fits and nothing runs (only reachable off the plan's
    # own trajectory): the highest-priority ready op at its largest valid level.
    valid = np.flatnonzero(mask)
    return int(min(valid, key=lambda a: (ep.rank[layout.decode(a)[0]], -a)))


def collect(env: Any, pairs: Sequence[tuple[Any, Any]], experts: Sequence[str], demos: Demonstrations,
            learner: Callable[[dict, np.ndarray], int] | None, model: Any = None,
            plans: dict | None = None, should_stop: Callable[[], bool] = lambda: False,
            keep: float = 1.0, rng: np.random.Generator | None = None,
            teacher: Callable[[Any], SlotPlan] | None = None) -> list[float]:
    """Play one episode per pair (the expert acts when ``learner`` is None) and record
    a random ``keep`` fraction of its states with the expert's label (consecutive
    states are nearly alike: a fraction of many episodes teaches more than all
    of a few); returns the episodes' returns.  ``teacher(env)``: the expert's
    slot plan for the env's episode (default: the best of ``experts``,
    :func:`expert_plan`; training uses the best known plan,
    :func:`opsched.agents.teachers.teacher_for_env`)."""
    plans = {} if plans is None else plans
    rng = rng if rng is not None else np.random.default_rng(0)
    returns = []
    for graph, machine in pairs:
        if should_stop():
            break
        obs, _ = env.reset(options={"graph": graph, "machine": machine})
        key = (id(graph), id(machine))
        if key not in plans:
            plans[key] = teacher(env) if teacher is not None else expert_plan(env, experts, model)
        ep = plans[key]
        demos.episodes.append({k: obs[k] for k in STATIC_KEYS if k in obs})
        e = len(demos.episodes) - 1
        rewards = []
        done = False
        kept: list[int] = []
        while not done:
            mask = env.action_masks()
            label = expert_action(env, ep, mask)
            if keep >= 1.0 or rng.random() < keep:
                kept.append(len(rewards))
                demos.episode_of.append(e)
                for k in STEP_KEYS:
                    demos.steps[k].append(obs[k])
                demos.masks.append(np.packbits(mask))
                demos.actions.append(label)
            action = label if learner is None else learner(obs, mask)
            obs, reward, done, _, _ = env.step(action)
            rewards.append(reward)
        rtg = np.cumsum(rewards[::-1])[::-1]
        demos.returns.extend(float(rtg[t]) for t in kept)
        returns.append(float(sum(rewards)))
    return returns


def level_loss(masked_logits: th.Tensor, actions: th.Tensor, n_nodes: int) -> th.Tensor:
    """Cross-entropy of the (device, thread level | wait) marginal -- the policy's
    probabilities summed over ops -- against the expert's (device, level).

    The joint cross-entropy also spends its gradient on *which* of several
    near-equal ready ops goes first; this term isolates the decision that
    costs the most when wrong (CPF's thread count, or waiting for it)."""
    per = MAX_DEVICES * MAX_LEVELS
    B = masked_logits.shape[0]
    ops = masked_logits[:, :-1].reshape(B, n_nodes, per).logsumexp(dim=1)
    marginal = th.cat([ops, masked_logits[:, -1:]], dim=1)
    target = th.where(actions == n_nodes * per, th.full_like(actions, per), actions % per)
    return th.nn.functional.cross_entropy(marginal, target)


def fit(policy: Any, demos: Demonstrations, steps: int, lr: float, batch_size: int, seed: int,
        should_stop: Callable[[], bool] = lambda: False, optimizer: th.optim.Optimizer | None = None,
        level_weight: float = 0.0) -> dict[str, float]:
    """``steps`` Adam steps on minibatches drawn from all demonstrations so far:
    cross-entropy (masked logits vs expert action) + 0.5 * value MSE.

    A fixed number of steps per round (not epochs over a growing set) keeps the
    warm start's cost known in advance."""
    encoder = policy.features_extractor
    n_actions = encoder.n_actions
    opt = optimizer or th.optim.Adam(policy.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    policy.set_training_mode(True)
    losses, hits = [], []
    for _ in range(steps):
        if should_stop():
            break
        idx = rng.choice(len(demos), size=min(batch_size, len(demos)), replace=False)
        obs, masks, actions, rtg = demos.batch(idx, n_actions)
        logits, value = encoder.logits_and_value(obs)
        logits = logits.masked_fill(~masks, -1e9)
        ce = th.nn.functional.cross_entropy(logits, actions)
        loss = ce + 0.5 * th.nn.functional.mse_loss(value.squeeze(1), rtg)
        if level_weight > 0:
            loss = loss + level_weight * level_loss(logits, actions, encoder.n_nodes)
        opt.zero_grad()
        loss.backward()
        th.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        hits.append(float((logits.argmax(1) == actions).float().mean()))
    policy.set_training_mode(False)
    tail = max(1, len(losses) // 4)  # the last quarter: where the round ended up
    return {"loss": float(np.mean(losses[-tail:])) if losses else float("nan"),
            "accuracy": float(np.mean(hits[-tail:])) if hits else float("nan")}


def warm_start(policy: Any, env: Any, pairs: Sequence[tuple[Any, Any]], experts: Sequence[str], *,
               rounds: int, steps: int, lr: float, batch_size: int, episodes_per_round: int, seed: int,
               first_episodes: int | None = None, keep: float = 1.0, model: Any = None,
               log: Callable[[str], None] = lambda s: None, should_stop: Callable[[], bool] = lambda: False,
               after_round: Callable[[int, dict[str, float]], None] | None = None,
               level_weight: float = 0.0, dagger: bool = True,
               teacher: Callable[[Any], SlotPlan] | None = None, resume: Any = None,
               save: Callable[[Any, np.random.Generator, th.optim.Optimizer], None] | None = None
               ) -> list[dict[str, float]]:
    """DAgger: round 0 the expert plays, later rounds the (greedy) learner plays
    (``dagger=False``: the expert plays every round -- plain behaviour cloning on
    more and more pairs); every state is labelled by the expert (``teacher(env)``,
    default the best of ``experts``) and the policy is refit on all of them.
    ``after_round(r, stats)`` runs after each round (the trainer evaluates there).

    Resumable (:mod:`opsched.agents.rounds`): ``save(state, rng, optimizer)``
    runs after every finished round, ``resume`` (a saved
    :class:`~opsched.agents.rounds.RoundState`, the policy already holding that
    round's weights) continues at its next round; a round cut short by
    ``should_stop`` is not saved, so it is played again in full."""
    from opsched.agents.evaluate import policy_actor
    from opsched.agents.rounds import RoundState, restore_optimizer

    state = resume if resume is not None else RoundState()
    rng = state.generator(np.random.default_rng(seed))
    demos = state.demos
    plans: dict = {}
    history = state.history
    opt = th.optim.Adam(policy.parameters(), lr=lr)
    restore_optimizer(opt, state)
    for r in range(state.next_round, rounds):
        if should_stop():
            break
        t0 = time.time()
        # Learning rate decays geometrically to lr/10 over the rounds: early
        # rounds move fast, late ones settle (less round-to-round variance).
        for group in opt.param_groups:
            group["lr"] = lr * 0.1 ** (r / max(rounds - 1, 1))
        n_eps = first_episodes if (r == 0 and first_episodes) else episodes_per_round
        pick = rng.choice(len(pairs), size=min(n_eps, len(pairs)), replace=False)
        chosen = [pairs[int(i)] for i in pick]
        learner = None if (r == 0 or not dagger) else policy_actor(policy)
        rets = collect(env, chosen, experts, demos, learner, model, plans, should_stop, keep, rng, teacher)
        stats = fit(policy, demos, steps, lr, batch_size, seed + r, should_stop, opt, level_weight)
        stats.update(round=r, samples=len(demos), played_return=float(np.mean(rets)) if rets else float("nan"),
                     seconds=time.time() - t0)
        if should_stop():
            break  # an unfinished round: played again on resume
        history.append(stats)
        log(f"imitation round {r}: {len(demos)} states, accuracy {stats['accuracy']:.3f}, "
            f"return of the {'learner' if learner else 'expert'} {stats['played_return']:.4f}")
        if after_round is not None:
            after_round(r, stats)
        if should_stop():
            history.pop()
            break
        state.next_round = r + 1
        if save is not None:
            save(state, rng, opt)
    return history


__all__ = ["Demonstrations", "ExpertPlan", "best_expert", "collect", "expert_action",
           "expert_plan", "fit", "warm_start"]
