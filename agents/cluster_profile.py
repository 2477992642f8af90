"""``opsched profile MODEL --cluster ray``: every distinct machine of a Ray cluster profiles itself.

1. **Which machines.**  A probe task runs on every alive node (node
   affinity, no CPU taken) and answers with the node's ``Machine.probe()``
   (affinity-aware: cores this node's processes may use) and its versions.
   Nodes with one fingerprint are one machine: one of them profiles it.
2. **Profiling.**  A task pinned to that node (node affinity, all its CPUs,
   so no other Ray work shares the cores) imports the model, profiles every
   op (:func:`opsched.backends.profiler.profile_graph`) and, with
   ``runtime``, measures whole plans and refits the machine's torch-cpu
   runtime model (:func:`opsched.backends.runtime_fit.calibrate`) - into a
   temporary cache on the node, seeded with what the driver's cache already
   holds for that machine.  Nodes on one host take turns (they would time each
   other's ops); different hosts work at once.
3. **Gathering.**  The node answers with the files it wrote (path inside the
   cache -> JSON text) and its machine description.  The driver checks each
   path and parses each file (a profile must be of that node's fingerprint)
   before writing it into its own cache, then records the machine
   (``machines/<fingerprint>.yaml``, :mod:`opsched.agents.profiled`), so
   ``train-policy --set profiled_machines=all`` finds it.

A machine whose profile the driver's cache already has is not measured again
unless ``refresh``.  Nothing but JSON text crosses the wire
(:mod:`opsched.agents.wire`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opsched.agents.cluster import ClusterError, check_versions, process_record
from opsched.agents.wire import WireError, parse_cache_file, safe_relpath


@dataclass
class ProfileRequest:
    """What a node is asked to measure (sent as JSON)."""

    spec: str
    batch: int = 1
    width: float = 1.0
    seed: int = 0
    threads: list[int] | None = None
    warmup: int = 3
    repeats: int = 30
    interference: bool = True
    runtime: bool = True
    runtime_plans: int = 16


# ------------------------------------------------------------- on the nodes
def probe_node() -> dict[str, Any]:
    """This node's machine (``Machine.probe()``), fingerprint and versions."""
    from opsched.machine import Machine

    m = Machine.probe()
    return {"machine": m.to_dict(), "fingerprint": m.fingerprint(), **process_record()}


def profile_node(request_json: str, expected: str, seed_files: dict[str, str]) -> dict[str, Any]:
    """Profile this node's machine (``expected``: its fingerprint as probed) into a temporary cache seeded
    with ``seed_files``; the files it wrote, as JSON text."""
    import tempfile

    from opsched.backends.profiler import profile_graph
    from opsched.engine.profiles import cache_path
    from opsched.machine import Machine
    from opsched.specs import load_graph

    req = ProfileRequest(**json.loads(request_json))
    machine = Machine.probe()
    if machine.fingerprint() != expected:
        raise ClusterError(f"node probed as {machine.fingerprint()} now, {expected} before")
    with tempfile.TemporaryDirectory(prefix="opsched-profile-") as tmp:
        cache = Path(tmp)
        for rel, text in seed_files.items():
            path = cache / safe_relpath(rel, "the driver")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        before = {p: p.read_text() for p in cache.rglob("*.json")}
        graph = load_graph(req.spec, batch=req.batch, width=req.width, seed=req.seed)
        prof = profile_graph(graph, machine, threads=req.threads, warmup=req.warmup, repeats=req.repeats,
                             refresh=True, cache_dir=cache, interference=req.interference, progress=False)
        runtime = None
        if req.runtime and graph.source is not None and type(graph.source).__name__ == "TorchSource":
            runtime = _fit_runtime(graph, req, machine, cache)
        files = {p.relative_to(cache).as_posix(): p.read_text() for p in sorted(cache.rglob("*.json"))
                 if before.get(p) != p.read_text()}
        return {"fingerprint": machine.fingerprint(), "machine": machine.to_dict(), "graph": graph.fingerprint(),
                "graph_name": graph.name, "profile": cache_path(graph, machine, cache).relative_to(cache).as_posix(),
                "ops": len(prof.ops), "levels": list(prof.levels), "runtime": runtime, "files": files,
                **process_record()}


def _fit_runtime(graph: Any, req: ProfileRequest, machine: Any, cache: Path) -> dict[str, Any]:
    from opsched.backends.runtime_fit import GraphRef, calibrate
    from opsched.engine.models.runtime import PlanningModel
    from opsched.planning import planning_model

    cpu = machine.cpu_only()
    perf = planning_model(cpu, "torch-cpu", "fitted", cache)
    perf = perf.perf if isinstance(perf, PlanningModel) else perf
    model, runs = calibrate(graph, GraphRef(req.spec, req.batch, req.width, req.seed), cpu, perf,
                            n_plans=req.runtime_plans, rounds=3, cache_dir=cache)
    return {"fitted_on_graphs": len(runs), "plans": sum(len(r.plans) for r in runs)}


# ------------------------------------------------------------- on the driver
def profile_cluster(ray: Any, request: ProfileRequest, out: str | Path, *, refresh: bool = False,
                    all_nodes: bool = False, log: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """Profile every distinct machine of the cluster into the cache ``out`` (see the module docstring);
    one row per machine: fingerprint, node, host, cores, what was done and where the profile is."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from opsched.agents.profiled import model_files, record_machine
    from opsched.backends.runtime_fit import runtime_dir
    from opsched.engine.profiles import cache_path
    from opsched.machine import Machine
    from opsched.specs import load_graph

    out = Path(out)
    graph = load_graph(request.spec, batch=request.batch, width=request.width, seed=request.seed)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        raise ClusterError("the Ray cluster has no alive node")
    probe = ray.remote(probe_node)
    refs = [probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote() for n in nodes]
    driver = process_record()
    by_fp: dict[str, list[tuple[dict, dict]]] = {}
    for node, rec in zip(nodes, ray.get(refs, timeout=300)):
        check_versions(driver, rec)
        by_fp.setdefault(rec["fingerprint"], []).append((node, rec))
    log(f"{len(nodes)} node(s), {len(by_fp)} distinct machine(s)")

    rows: list[dict[str, Any]] = []
    todo: list[tuple[dict, dict, Any]] = []
    for fp, members in sorted(by_fp.items()):
        machine = Machine.from_dict(members[0][1]["machine"], where=f"node {members[0][1].get('node_ip')}")
        if machine.fingerprint() != fp:
            raise WireError(f"node {members[0][1].get('node_ip')}: its machine does not match its fingerprint")
        record_machine(machine, out)
        chosen = members if all_nodes else members[:1]
        if cache_path(graph, machine, out).exists() and not refresh:
            rows.append(_row(members[0][0], members[0][1], machine, "cached", cache_path(graph, machine, out),
                             len(members)))
            continue
        for node, rec in chosen:
            todo.append((node, rec, machine))

    profile = ray.remote(profile_node)
    req_json = json.dumps(request.__dict__)
    queues: dict[str, list[tuple[dict, dict, Any]]] = {}
    for item in todo:  # nodes on one host take turns
        queues.setdefault(str(item[0].get("NodeManagerHostname")), []).append(item)

    def submit(item: tuple[dict, dict, Any]) -> Any:
        node, rec, machine = item
        seed = model_files([machine], out)
        rdir = runtime_dir(machine, out)
        if rdir.is_dir():
            seed.update({p.relative_to(out).as_posix(): p.read_text() for p in rdir.glob("*.json")})
        cpus = float(node.get("Resources", {}).get("CPU", 1.0))
        log(f"profiling {graph.name} on {rec.get('node_ip')} (machine {machine.fingerprint()}, "
            f"{machine.cpu.cores} cores)")
        return profile.options(num_cpus=cpus, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node["NodeID"], soft=False)).remote(req_json, machine.fingerprint(), seed)

    running: dict[Any, tuple[str, tuple[dict, dict, Any]]] = {}
    for host, q in queues.items():
        item = q.pop(0)
        running[submit(item)] = (host, item)
    while running:
        done, _ = ray.wait(list(running), num_returns=1)
        host, (node, rec, machine) = running.pop(done[0])
        try:
            result = ray.get(done[0])
        except ray.exceptions.RayTaskError as exc:
            raise ClusterError(f"profiling on node {rec.get('node_ip')} failed: "
                               f"{str(exc).strip().splitlines()[-1]}") from None
        path = _gather(result, machine, graph, out)
        rows.append(_row(node, rec, machine, "measured", path, len(by_fp[machine.fingerprint()]),
                         runtime=result.get("runtime")))
        if queues[host]:
            item = queues[host].pop(0)
            running[submit(item)] = (host, item)
    return rows


def _gather(result: dict[str, Any], machine: Any, graph: Any, out: Path) -> Path:
    """Check and write a node's files into the driver's cache; the profile's path."""
    from opsched.backends.runtime_fit import runtime_dir
    from opsched.engine.profiles import Profile, ProfileError, cache_path
    from opsched.io import atomic_write_text

    where = f"node {result.get('node_ip')}"
    if result.get("fingerprint") != machine.fingerprint() or result.get("graph") != graph.fingerprint():
        raise WireError(f"{where}: profiled machine {result.get('fingerprint')} / graph {result.get('graph')}, "
                        f"asked for {machine.fingerprint()} / {graph.fingerprint()}")
    allowed_dir = runtime_dir(machine, Path(".")).as_posix()
    for rel, text in result["files"].items():
        data = parse_cache_file(rel, text, where)
        p = safe_relpath(rel, where)
        if len(p.parts) == 1:  # a profile: it must be this node's
            try:
                prof = Profile.from_dict(data, where=f"{where}: {rel}")
            except ProfileError as exc:
                raise WireError(str(exc)) from None
            if prof.machine_fingerprint != machine.fingerprint():
                raise WireError(f"{where}: {rel} profiles machine {prof.machine_fingerprint}, not this node's")
        elif not p.as_posix().startswith(allowed_dir + "/"):
            raise WireError(f"{where}: {rel} is outside this machine's runtime folder {allowed_dir}")
        target = out / p
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, text)
    return cache_path(graph, machine, out)


def _row(node: dict, rec: dict, machine: Any, what: str, path: Path, n_nodes: int,
         runtime: dict | None = None) -> dict[str, Any]:
    return {"fingerprint": machine.fingerprint(), "node_ip": rec.get("node_ip"), "host": rec.get("host"),
            "nodes": n_nodes, "cores": machine.cpu.cores, "cpu": machine.cpu.name, "done": what,
            "profile": str(path), "runtime": runtime}
