"""``opsched profile --cluster``: the command's side (parse, print) of :mod:`opsched.agents.cluster_profile`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table


def profile_on_cluster(console: Any, cluster: str, spec: str, batch: int, width: float, seed: int,
                       levels: list[int] | None, warmup: int, repeats: int, interference: bool, runtime: bool,
                       runtime_plans: int, refresh: bool, out: Path) -> list[dict[str, Any]]:
    """Profile ``spec`` on every distinct machine of the cluster; print one row per machine."""
    from opsched.agents.cluster import connect, parse_cluster
    from opsched.agents.cluster_profile import ProfileRequest, profile_cluster

    ray = connect(parse_cluster(cluster))
    request = ProfileRequest(spec=spec, batch=batch, width=width, seed=seed, threads=levels, warmup=warmup,
                             repeats=repeats, interference=interference, runtime=runtime, runtime_plans=runtime_plans)
    rows = profile_cluster(ray, request, out, refresh=refresh, log=console.print)
    table = Table(title=f"{spec} on the cluster {cluster}: one profile per machine, in {out}")
    for col in ("machine (fingerprint)", "cores", "CPU", "nodes", "profiled on", "done", "runtime model"):
        table.add_column(col)
    for r in rows:
        rt = "" if not r["runtime"] else f"refitted ({r['runtime']['plans']} plans)"
        table.add_row(r["fingerprint"], str(r["cores"]), r["cpu"], str(r["nodes"]), str(r["node_ip"]), r["done"], rt)
    console.print(table)
    console.print("train on these machines' planning models: opsched train-policy --set profiled_machines=all "
                  f"--set profiles_dir={out}")
    return rows
