"""Graphi's critical-path-first scheduling (Tang, Wang, Willke and Li, 2018).

Graphi runs a computation graph on a manycore CPU with ``E`` isolated
*executors*, each a team of ``T`` threads pinned to its own cores, and a
central scheduler that hands each idle executor the ready op with the highest
*upward rank* (the longest remaining path to the end of the graph, so the
critical path never waits behind side branches).  Which ``E x T`` split is best
depends on the graph -- many small independent ops favour many thin
executors, a chain of big convolutions favours few wide ones -- so Graphi
*profiles* the graph under each split and keeps the fastest.

As a Plan: every op gets ``T`` threads on the device and priority = its upward
rank (computed from the op times at ``T`` threads).  With ``E = cores // T`` the
device's core slots hold exactly ``E`` ops of ``T`` threads, so at most ``E``
run at once and an op starts the moment an "executor" frees -- the plan
semantics are Graphi's dispatch loop.  The profiling step runs each candidate
split through the simulator with the given performance model (a profile-fitted
model makes that a profile of the real machine).  On a machine with GPUs the
default GPU, with one executor per stream, is profiled as well.
"""

from __future__ import annotations

from typing import Any

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Assignment, Plan
from opsched.policies.base import MODEL_MAKESPAN, PRUNE_RTOL, Policy, build_plan, resolve_model, split_bound
from opsched.policies.registry import BASELINE, HINT, TEACHER, register


@register("critical-path-first", roles=(BASELINE, HINT, TEACHER), aliases=("cpf", "graphi"), order=3)
class CriticalPathFirst(Policy):
    """Graphi: profile the executor split, then dispatch by upward rank."""

    name = "critical-path-first"

    def candidate_configs(self, machine: Machine) -> list[tuple[str, int, int]]:
        """(device id, executors, threads per executor) splits to profile."""
        cpu = machine.cpu
        configs = [("cpu", cpu.cores // t, t) for t in cpu.thread_levels()]
        if machine.gpus:
            gpu = machine.gpus[0]
            configs.append((gpu.id, gpu.cores, 1))
        return configs

    def plan_for(self, graph: OpGraph, machine: Machine, table: Any, device: str, threads: int,
                 rank: Any = None, **meta: Any) -> Plan:
        """The critical-path-first plan for one executor split (``rank``: the upward
        ranks at ``threads``, when the caller has them)."""
        if rank is None:
            rank = graph.upward_rank_array(table.on(machine.device_index[device], threads))
        assignments = {op.id: Assignment(device, threads, float(rank[i])) for i, op in enumerate(graph.ops)}
        return build_plan(graph, machine, assignments, policy=self.name, device=device, threads=threads, **meta)

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        """Profile the splits in the simulator and keep the fastest (the first on ties).

        A split is simulated only when it could win: no plan of ``E`` executors of ``T``
        threads runs faster than its critical path at ``T`` threads nor than its work at
        ``T`` threads over ``E`` (:func:`split_bound`), so a split whose bound exceeds the
        fastest makespan found so far is skipped - the splits go in the order of their
        bounds, and on 200-op graphs one simulation of eight usually decides.  The plan is
        the one exhaustive profiling picks; ``meta["profile"]`` holds the simulated
        makespans, ``meta["skipped"]`` the bounds of the splits left out."""
        from opsched.engine.sim import Simulator

        model = resolve_model(model)
        table = model.time_table(graph, machine)
        sim = Simulator(machine, model=model)
        splits = []
        for k, (device, executors, threads) in enumerate(self.candidate_configs(machine)):
            times = table.on(machine.device_index[device], threads)
            rank = graph.upward_rank_array(times)
            splits.append((split_bound(rank, times, executors), k, device, executors, threads, rank))
        profile: dict[str, float] = {}
        skipped: dict[str, float] = {}
        best: tuple[float, int, Plan] | None = None
        for bound, k, device, executors, threads, rank in sorted(splits, key=lambda s: (s[0], s[1])):
            key = f"{device} {executors}x{threads}"
            if best is not None and bound > best[0] * (1.0 + PRUNE_RTOL):
                skipped[key] = bound
                continue
            plan = self.plan_for(graph, machine, table, device, threads, rank, executors=executors)
            makespan = sim.makespan(graph, plan, validate=False)  # build_plan validated it
            profile[key] = makespan
            if best is None or (makespan, k) < (best[0], best[1]):
                best = (makespan, k, plan)
        assert best is not None, "a machine has a CPU, so there is a split"
        plan = best[2]
        return Plan(plan.assignments, plan.graph_fingerprint, plan.machine_fingerprint, plan.policy,
                    {**plan.meta, "profile": profile, "skipped": skipped, MODEL_MAKESPAN: best[0]})
