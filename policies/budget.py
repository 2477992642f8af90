"""The plan-time search's budget: what a graph smaller than the budget graph may spend.

The exported scheduler's default search is sized for a graph of
``budget_ops`` (200) ops: its heuristics, its greedy decoding and ``refine``
local-search steps take about 100 ms there on one core (issue 23's target).
A smaller graph plans faster - about 0.5 ms per op on the presets, the
heuristics included - and leaves the rest of that budget unspent, while the
search is worth most on exactly such graphs (a 40-op graph on a machine with
slow links or busy cores, where list heuristics are 1.2x off).  So
:func:`search_budget` spends the spare time, deterministically (the same
graph on the same machine, the same search and the same plan; a clock would
make the plan depend on the load):

1. **LP rounding** (:mod:`opsched.policies.lp_rounding`, the best baseline on
   a share of the validation pairs but costing 0.15-0.5 x (CPU-only) to 1.5-4 x
   (with GPUs: one LP per placement) the base cost per op, counted as 0.5 x and
   3 x) becomes a candidate when its cost fits in the spare budget;
2. a share ``fill`` of what is left buys more local-search steps (each costs
   about 0.002 x the base cost per op with the compiled replay: one replay of
   the slot plan);
3. **biCPA** (:data:`BUDGET_FREE_EXTRA`) becomes a candidate where its cost
   fits the spare budget, on top of LP rounding and the steps, not paid for
   with them.

Costs are in *op units*: the base planning cost of one op (the default
candidates plus the greedy decoding), so the rule does not depend on how fast
the planning computer is.  Measured on the 2-core VM by timing each part
alone (the three synthetic families at 25-200 ops on four presets, one core,
the heuristics' cache cleared; ``python -m opsched.benchmarks.budget_costs``,
docs/bench/budget_costs.md; the totals per size that result are in
``python -m opsched.benchmarks.plan_budget``, docs/bench/plan_budget.md).
With the general replay: base 0.44-0.54 ms per op on CPU presets and 0.6-0.8
with GPUs, one step 3-9 us per op (0.006-0.018 units; a step was counted as
0.015), LP rounding 0.06-0.24 ms per op without GPUs and 1.0-2.2 with them.
With the compiled makespan replay (:mod:`opsched.engine.fast_replay`) a step
costs 0.5-3.2 us per op (median 1.5-1.7; 0.0007-0.0074 units over a base of
0.25-0.89 ms per op), so :data:`STEP_COST` went from 0.015 to 0.005 (2.5 us
at 0.5 ms per op, near the worst case as before): a 25-op graph gets about 3x
the steps.  Chosen on the selection sets (``python -m
opsched.benchmarks.plan_budget --fills 0.7,1 --seeds 3 --step-cost C
--no-large``, three plan seeds, mean of the seeds' geometric means): at
fill 0.7, validation 1.0009 -> 0.9892 (seed spread 0.9991-1.0020 ->
0.9842-0.9954) and the hard training pairs 0.9854 -> 0.9688; planning a
25-op graph 34 -> 65 ms (median case), every size below the 200-op graph's
94-105 ms.  Fill 1 would gain another 0.4% (0.9856) but plans 25-op graphs
in 87 ms, at the 200-op graph's time, so ``fill`` stays 0.7.
Then the replay took one compiled call per step (a slot plan read as it
is, the holds merged by compiled code and kept per hold set, busy cores
priced in the compiled loop): a step costs 2.2-3.2x less (min of 7 runs of
500 steps, interleaved with the code before: 89 -> 33 us on an 80-op graph,
47 -> 21 us on 25 ops, 175 -> 56 us on 120 ops with GPUs; 850 -> 44 us on
the busy-cores machine, whose replays took the general loop before), median
0.0012-0.0015 units, so :data:`STEP_COST` went from 0.005 to 0.002, the
margin over the median as before.  On the selection sets (``python -m
opsched.benchmarks.step_cost --costs 0.005,0.002,0.0015 --seeds 3``,
docs/bench/step_cost.md; three plan seeds, mean of their geometric means):
validation 0.9864 -> 0.9744, the hard training pairs 0.9628 -> 0.9422, the
training split's synthetic graphs 0.9647 -> 0.9533, no (pair, seed) case
worse (more steps from the same seed only go further); median planning
+12-18 ms on those graphs (0.0015 would gain another 0.2-0.8% for another
7-9 ms).
Graphs at or above ``budget_ops`` get exactly
``refine`` steps and no extra candidate: the budget is theirs already.  So do
graphs the policy coarsens (more ops than its ``max_nodes``, 128 for the
shipped one; :meth:`opsched.policies.exported.ExportedPolicy.plan_candidates`
passes them as budget-sized): planning one costs about as much as the
budget graph (0.6-0.7 ms per op at 150 ops), so they have nothing to spare
(but see the two ``large_baselines`` rules below).

**Graphs larger than the budget graph** (``large_baselines``).  The 100 ms
target is for a 200-op graph; nothing bounds a bigger one, and a training
step is one (600-3000 ops), planned once and run thousands of times.  There
biCPA and LP rounding, left out by the rule above, are often the best plans
on a machine without GPUs, so with ``large_baselines`` both join the
candidates on such a machine whatever they cost (:data:`LARGE_EXTRA`): every
baseline heuristic is then a default candidate, and the plan is never slower
than the best of them under the planning model.  On the benchmark's 20 pairs
without GPUs (308-1139 ops): 1.029 -> 0.999x the best baseline's makespan
(worst 1.19 -> 1.00), median planning 146 -> 320 ms (worst 476 -> 1036);
LP rounding alone gave 1.007 (worst 1.10) at 183 ms.  Not on machines with GPUs, where LP rounding's
placement LP takes 1-4 s on the same graphs (HiGHS's interior point, a
variable per edge and device); its gain there comes from that LP: without it
(the CPU's and HEFT's placements only) LP rounding added nothing on the 40
pairs with GPUs (1.0183 -> 1.0182), and a placement LP on the policy's 128
coarse groups (thread counts on the full graph) recovered half of it
(1.0183 -> 1.0101, against 1.0000 with the full LP) for +100-700 ms.
Chosen on graphs and machines the test split never sees (``python -m
opsched.benchmarks.plan_budget``, docs/bench/plan_budget.md).

**Coarsened graphs of at most ``budget_ops`` ops** (``large_baselines`` too).
A graph the policy coarsens (129-200 ops for the shipped one) is charged as
the budget graph, so the rules above gave it nothing but its ``refine``
steps, and on a machine without GPUs that left out the plan that is most
often the best there: LP rounding (the default search was up to 1.17x the
best baseline).  With ``large_baselines`` such a graph on such a machine gets
LP rounding as a candidate (:data:`COARSE_EXTRA`) *instead of* local search:
its cost in op units (:data:`LP_COST`) is taken from ``refine``'s steps
(:data:`STEP_COST` each), which leaves none of the default 10, and its plan
joins the hint's (:func:`hint_extra`, :data:`COARSE_HINT`).  Chosen on 24
pairs the test split never holds (the training split's resnet50 variants and
six synthetic graphs of 140-200 ops with seeds no split uses, each on three
CPU-only training machines; ``python -m opsched.benchmarks.coarse_budget``,
docs/bench/coarse_budget.md), makespan over the best baseline, default
search / greedy decoding, and CPU ms per plan:

* the 10 steps (before): 1.031 / 1.033 (worst 1.169), 65 ms;
* LP rounding, in the hint too (shipped until then): 1.001 / 1.003 (worst 1.033), 71 ms;
* LP rounding, not in the hint: 1.001 / 1.033, 71 ms;
* LP rounding and biCPA (shipped since the compiled makespan replay,
  :mod:`opsched.engine.fast_replay`): 1.000 / 1.002, 83 ms - the best, but
  with the replays run as Python it put the 200-op CPU cases of the planning
  target at 102-111 ms, so it waited; compiled, the same rules took 45 ms
  (before), 57 (LP rounding) and 67 (both), and the planning target's CPU
  cases 77-83 ms with both.

In the hint, the extras' plans are kept out of
:func:`opsched.policies.hints.slot_hint`'s bounded projection search and
projected after it (:data:`opsched.policies.hints.EXTRAS_APART`): inside
it, LP rounding's plan, often the fastest and projecting to itself, ended
the search before a slower plan whose projection beats every plan (found on
the test split's layered:200:901 on the Xeon, 1.007 -> 1.288x; on the
selection set above 1.0011 / 1.0036 -> 1.0008 / 1.0033 kept apart, on the
training split's 66 coarsened pairs no hint changed; docs/learning.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Planning cost of LP rounding per op, in op units, on a machine without / with GPUs.
LP_COST: dict[bool, float] = {False: 0.5, True: 3.0}
#: Planning cost of one local-search step per op, in op units.
STEP_COST = 0.002
#: No graph gets more local-search steps than this (a 5-op graph would otherwise get thousands).
MAX_STEPS = 2000
#: The default search's budget graph (``budget_ops``) and the share of spare planning time it
#: spends (``fill``): :data:`opsched.policies.exported.DEFAULT_PLANNING` holds these.
BUDGET_OPS = 200
FILL = 0.7
#: The heuristic the spare budget may add as a candidate.
BUDGET_EXTRA = "lp-rounding"
#: The heuristics a graph larger than the budget graph gets as candidates on a machine without GPUs
#: (``large_baselines``): the baselines that are not default candidates.
LARGE_EXTRA: tuple[str, ...] = ("bicpa", "lp-rounding")
#: Planning cost of biCPA per op, in op units, on a machine without GPUs (measured 0.035-0.11 ms per op).
BICPA_COST = 0.2
#: The heuristic a graph below the budget graph gets as a candidate where its cost
#: (:data:`BICPA_COST` per op, at that cost with GPUs too: biCPA plans from HEFT's
#: placement there) fits the graph's spare budget, on top of LP rounding and *without*
#: taking it from the local-search steps (empty: none).  biCPA is the best baseline by
#: 10-31% on graphs whose co-running ops fight over memory bandwidth, where no other
#: candidate comes near; paid for with steps, as another spare-budget candidate, it lost
#: validation 0.05% (``python -m opsched.benchmarks.rejected --what bicpa``).  Free,
#: three plan seeds of the default search (``python -m opsched.benchmarks.budget_free``,
#: docs/bench/budget_free.md), without -> with it: validation unchanged (0.9936, 0.9850,
#: 0.9806: no validation pair's plan moves), the hard families' training pairs 0.9662 /
#: 0.9700 / 0.9703 -> 0.9593 / 0.9656 / 0.9634, the training split's synthetic graphs
#: 0.9677 / 0.9672 / 0.9653 -> 0.9655 / 0.9642 / 0.9643; the greedy decoding, whose hint
#: gets its plan (:func:`hint_extra`), 1.0046 -> 1.0000 and 1.0098 -> 1.0064 there, no
#: pair worse.  (First measured where biCPA's cost had to fit what LP rounding left, up
#: to 117 ops without GPUs: the same but for the hard pairs' 0.9649 / 0.9686 / 0.9674,
#: a 120-op pair among them.)  Cost: a median 4-9 ms more per plan on the graphs that
#: get it (every graph the shipped policy does not coarsen: at most 128 ops); such a
#: graph may then cost up to 12% more than the 200-op budget graph (1.7 n op units and
#: what steps the rest buys at 118-128 ops without GPUs: 223 at 128), and the budget
#: graph itself is untouched.
BUDGET_FREE_EXTRA = "bicpa"
#: What a coarsened graph of at most the budget graph's size gets on a machine without GPUs
#: (``large_baselines``), paid for with local-search steps.
COARSE_EXTRA: tuple[str, ...] = ("lp-rounding", "bicpa")
#: Whether :data:`COARSE_EXTRA` joins the hint's plans too (:func:`hint_extra`).
COARSE_HINT = True


def coarse_steps(extra: tuple[str, ...]) -> int:
    """Local-search steps the coarsened rule's ``extra`` candidates cost: their op units
    (LP rounding's :data:`LP_COST` without GPUs, :data:`BICPA_COST`) over a step's, rounded up."""
    return math.ceil(sum(LP_COST[False] if h == "lp-rounding" else BICPA_COST for h in extra) / STEP_COST)


#: Local-search steps :data:`COARSE_EXTRA` costs.
COARSE_STEPS = coarse_steps(COARSE_EXTRA)


@dataclass(frozen=True)
class SearchBudget:
    """What the default search runs on one graph: ``steps`` local-search steps
    and the ``extra`` candidate heuristics beyond the default ones."""

    steps: int
    extra: tuple[str, ...] = ()


def search_budget(n_ops: int, has_gpu: bool, refine: int, fill: float, budget_ops: int,
                  large_baselines: bool = False, coarsened: bool = False) -> SearchBudget:
    """The search for a graph of ``n_ops`` ops: ``refine`` steps, plus LP rounding
    and more steps where the graph is smaller than ``budget_ops`` (see the module
    docstring).  ``refine = 0`` turns local search off whatever the budget (the
    extra candidate may still come); ``fill = 0`` or ``budget_ops = 0`` spends no
    spare budget at all (exactly ``refine`` steps, no extra candidate).
    ``large_baselines``: a graph of more than ``budget_ops`` ops (``budget_ops > 0``)
    on a machine without GPUs gets :data:`LARGE_EXTRA` as candidates, and
    exactly ``refine`` steps; a ``coarsened`` one of at most ``budget_ops`` ops
    (``n_ops`` is then :func:`planned_size`'s charge, ``budget_ops`` itself) gets
    :data:`COARSE_EXTRA`, bought with ``refine``'s steps at their op-unit costs."""
    if n_ops < 1 or refine < 0 or not 0.0 <= fill <= 1.0 or budget_ops < 0:
        raise ValueError(f"search_budget: need n_ops >= 1, refine >= 0, 0 <= fill <= 1 and budget_ops >= 0, "
                         f"got {n_ops}, {refine}, {fill}, {budget_ops}")
    spare = float(budget_ops - n_ops)
    if large_baselines and not has_gpu and 0 < budget_ops < n_ops:
        return SearchBudget(refine, LARGE_EXTRA)
    if large_baselines and not has_gpu and coarsened and 0 < budget_ops == n_ops and COARSE_EXTRA:
        return SearchBudget(max(0, refine - COARSE_STEPS), COARSE_EXTRA)
    if fill == 0.0 or spare <= 0.0:
        return SearchBudget(refine)
    extra: tuple[str, ...] = ()
    free = bool(BUDGET_FREE_EXTRA) and BICPA_COST * n_ops <= spare  # on top of everything: see BUDGET_FREE_EXTRA
    lp = LP_COST[bool(has_gpu)] * n_ops
    if lp <= spare:
        extra, spare = (BUDGET_EXTRA,), spare - lp
    if free:
        extra = (*extra, BUDGET_FREE_EXTRA)
    steps = refine
    if refine:
        steps = min(MAX_STEPS, max(refine, refine + int(fill * spare / (STEP_COST * n_ops))))
    return SearchBudget(steps, extra)


def planned_size(n_ops: int, max_nodes: int, budget_ops: int) -> int:
    """The op count the budget charges a graph of ``n_ops`` ops for: its own, or at
    least ``budget_ops`` when the policy coarsens it (more than ``max_nodes`` ops),
    since planning a coarsened graph costs about as much as the budget graph."""
    return max(1, n_ops if n_ops <= max_nodes else max(n_ops, budget_ops))


def hint_extra(n_ops: int, max_nodes: int, has_gpu: bool) -> tuple[str, ...]:
    """The heuristics the *default* search adds as candidates for a graph of ``n_ops`` ops
    (:func:`search_budget`'s ``extra`` at :data:`BUDGET_OPS`, :data:`FILL`, large baselines
    on): LP rounding where it fits the spare budget, LP rounding and biCPA where the graph
    is coarsened and at most the budget graph's size (:data:`COARSE_EXTRA`), biCPA and LP
    rounding on a graph larger than the budget graph; the last two without GPUs only.

    A policy exported with ``hint_budget`` (:mod:`opsched.policies.exported`) adds them
    to its hint heuristics, in training and at plan time alike, so its greedy decoding
    is hinted with every plan the default search computes anyway.  Fixed, not read from
    a plan call's options: the hint is part of the observation, which must be the one
    the policy was trained on whatever search a user asks for.  Measured with the
    shipped weights (the greedy decoding / the best baseline heuristic; issue 23,
    docs/learning.md): validation 1.0157 -> 1.0109, the training split's coarsened
    graphs (66 pairs) 1.0341 -> 1.0156, worst 1.615 -> 1.229."""
    return search_budget(planned_size(n_ops, max_nodes, BUDGET_OPS), has_gpu, 0, FILL, BUDGET_OPS, True,
                         COARSE_HINT and n_ops > max_nodes).extra


__all__ = ["BICPA_COST", "BUDGET_EXTRA", "BUDGET_FREE_EXTRA", "BUDGET_OPS", "COARSE_EXTRA", "COARSE_STEPS", "FILL", "LARGE_EXTRA", "LP_COST", "MAX_STEPS", "STEP_COST", "SearchBudget",
           "coarse_steps", "hint_extra", "planned_size", "search_budget"]
