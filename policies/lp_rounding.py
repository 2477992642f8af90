"""Two-phase LP rounding: the allocation LP rounded, then list scheduling
(Lepere, Trystram and Woeginger, IJFCS 2002; Jansen and Zhang, SODA 2005 / TALG 2006).

Phase 1 solves the allocation LP (:func:`opsched.engine.bounds.allocation_lp`:
the relaxation of the discrete time-cost trade-off, ``min max(critical path,
work / P)`` over fractional allocations) and rounds each op's fractional
duration ``x`` to an allocation: between the two neighbouring allocations of
its (convexified) time-work curve, ``t_fast < x < t_slow``, it takes the
faster (wider) one when ``x <= t_fast + rho (t_slow - t_fast)``, else the
slower.  Phase 2 caps every allocation at ``mu`` processors and
list-schedules (an op starts when its processors are free, by bottom level).

The parameters with guarantees (for monotone tasks): LTW's ``rho = 1/2``,
``mu = ceil((3 - sqrt 5) / 2 * P)`` (ratio ``3 + sqrt 5``, about 5.24), and
Jansen-Zhang's ``rho = 0.43``, ``mu = (93 P - sqrt(4349 P^2 - 4300 P)) / 100``
(about ``0.27 P``, ratio about 4.73).  The policy rounds with both, and
without a cap (``rho = 1/2``, ``mu = P``), and keeps the fastest plan in the
simulator (so the guarantee of the Jansen-Zhang candidate carries over to the
model the plans are judged by only as far as that model is monotone; opsched's
analytic model is not always, which is why the cap-free candidate is there).
A cap is snapped down to a thread level.

Machines with GPUs: the LP places ops fractionally across devices; each op
goes to the device that carries most of its weight and is rounded there (a
GPU op takes one stream).  That placement is often poor (the relaxation
splits ops across identical GPUs to dodge transfers), so the LP is also
solved with each placement the other moldable heuristics try (every op on
the CPU; HEFT's GPU ops on their GPUs, :func:`~opsched.policies.moldable.placements`),
choosing thread counts only, and every rounding of every LP competes.
Priorities are bottom levels at the rounded times.
Busy cores: ``P`` is the free cores, and no allocation exceeds them
(:mod:`opsched.policies.moldable`).
"""

from __future__ import annotations

import math

import numpy as np

from opsched.engine.bounds import AllocationLP, allocation_lp
from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Assignment, Plan
from opsched.policies.base import MODEL_MAKESPAN, Policy, build_plan
from opsched.policies.moldable import free_cores, longest_paths, placements, simulate
from opsched.policies.registry import BASELINE, register


def ltw_mu(P: int) -> int:
    """Lepere-Trystram-Woeginger's cap: ceil((3 - sqrt 5) / 2 * P)."""
    return max(1, min(P, math.ceil((3.0 - math.sqrt(5.0)) / 2.0 * P)))


def jz_mu(P: int) -> int:
    """Jansen-Zhang's cap: (93 P - sqrt(4349 P^2 - 4300 P)) / 100, rounded, in 1..P."""
    v = (93.0 * P - math.sqrt(max(0.0, 4349.0 * P * P - 4300.0 * P))) / 100.0
    return max(1, min(P, int(round(v))))


#: (label, rho, cap as a function of P) of the candidates the policy tries.
SETTINGS = (("jz", 0.43, jz_mu), ("ltw", 0.5, ltw_mu), ("uncapped", 0.5, lambda P: P))


def round_allocation(lp: AllocationLP, i: int, rho: float) -> tuple[int, int]:
    """Op ``i``'s (device index, threads) rounded from the LP's fractional solution."""
    w = lp.weights[i]
    d = int(np.argmax(lp.placement[i]))
    cand = sorted((a for a in lp.candidates[i] if a.device == d), key=lambda a: a.time)  # fast (wide) first
    if len(cand) == 1:
        return d, cand[0].threads
    time_of = {a.threads: a.time for a in cand}
    mass = sum(v for (dd, _), v in w.items() if dd == d)
    x = sum(v * time_of[k] for (dd, k), v in w.items() if dd == d) / mass
    for fast, slow in zip(cand, cand[1:]):
        if fast.time <= x <= slow.time:
            if slow.time <= fast.time:
                return d, fast.threads
            return d, fast.threads if x <= fast.time + rho * (slow.time - fast.time) else slow.threads
    return d, (cand[0] if x <= cand[0].time else cand[-1]).threads


def _snap(levels: tuple[int, ...], k: int) -> int:
    ok = [t for t in levels if t <= k]
    return ok[-1] if ok else levels[0]


@register("lp-rounding", roles=(BASELINE,), order=9)
class LPRounding(Policy):
    """Two-phase LP rounding plus list scheduling (see the module docstring)."""

    name = "lp-rounding"

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        from opsched.engine.sim import prepare

        static = prepare(graph, machine, model)
        lps = [("lp", allocation_lp(graph, machine, model))]
        if machine.gpus:  # also the placements the other moldable heuristics try, thread counts from the LP
            lps += [(where, allocation_lp(graph, machine, model, placement=placement))
                    for where, placement in placements(graph, machine, model)]
        cpu = machine.cpu
        P = free_cores(cpu)
        levels = tuple(k for k in cpu.thread_levels() if k <= P) or (1,)
        best: tuple[float, Plan] | None = None
        spans: dict[str, float] = {}
        for where, lp in lps:
            if not lp.weights:  # no LP solution for this placement
                continue
            seen: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}  # settings often round alike
            rounded: dict[float, list[tuple[int, int]]] = {}
            for label, rho, cap_of in SETTINGS:
                cap = _snap(levels, cap_of(P))
                if rho not in rounded:
                    rounded[rho] = [round_allocation(lp, i, rho) for i in range(len(graph.ops))]
                chosen = rounded[rho]
                dev = [d for d, _ in chosen]
                thr = [1 if machine.devices[d].is_gpu else min(_snap(levels, k), cap) for d, k in chosen]
                key = f"{where}:{label}"
                if (tuple(dev), tuple(thr)) in seen:  # the same plan, the same makespan: it cannot win the tie
                    spans[key] = seen[tuple(dev), tuple(thr)]
                    continue
                dur = np.array([static.time_and_demand(i, dev[i], thr[i])[0] for i in range(len(graph.ops))])
                _, bottom = longest_paths(graph, dur)
                assignments = {op.id: Assignment(machine.devices[dev[i]].id, thr[i], float(bottom[i]))
                               for i, op in enumerate(graph.ops)}
                plan = build_plan(graph, machine, assignments, policy=self.name)
                spans[key] = seen[tuple(dev), tuple(thr)] = simulate(graph, machine, model, plan)
                if best is None or spans[key] < best[0]:
                    best = (spans[key], plan)
        if best is None:  # the LP failed everywhere: one op after another at full width is still a plan
            from opsched.policies.heuristics import Sequential

            return Sequential().plan(graph, machine, model)
        return build_plan(graph, machine, best[1].assignments, policy=self.name,
                          chosen=min(spans, key=spans.__getitem__), candidates=spans,
                          lp_bound_s=lps[0][1].bound, **{MODEL_MAKESPAN: best[0]})


__all__ = ["LPRounding", "SETTINGS", "jz_mu", "ltw_mu", "round_allocation"]
