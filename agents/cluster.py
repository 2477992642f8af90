"""Many machines through Ray: connecting, describing the cluster, one custom resource per machine.

opsched uses Ray (the optional extra ``opsched[cluster]``) for three things,
each in its own module:

* env workers of ``train-policy --cluster ray`` as Ray actors
  (:mod:`opsched.agents.ray_vec_env`), the learner staying on the driver;
* ``profile --cluster ray``: every distinct machine of the cluster profiles
  itself (:mod:`opsched.agents.cluster_profile`);
* real-execution fine-tuning (``--backend torch-cpu``): each rollout worker
  runs on a node of the machine it is for, through the custom resource
  :func:`machine_resource` that node was started with.

``--cluster`` takes ``ray`` (``ray.init()``'s own choice: ``RAY_ADDRESS``, a
cluster started on this host with ``ray start``, else a fresh local one) or
``ray:ADDRESS`` (``ray:10.0.0.5:6379``, ``ray:auto``, ``ray:ray://host:10001``).
Ray is imported only here and only when a command asks for a cluster; without
it the command stops with one line saying how to install it.

A node advertises the machine it is with ``ray start ... --resources
"$(python -m opsched.agents.cluster resources)"``: one unit of
``opsched_machine_<fingerprint>``, which a real rollout worker takes whole,
so no two measured rollouts share a node's cores.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from opsched.errors import OpschedError

#: Prefix of the custom resource a node of a given machine offers (one unit per node).
RESOURCE_PREFIX = "opsched_machine_"
INSTALL_HINT = "pip install 'opsched[cluster]' (Ray 2.60)"
#: Packages whose versions must agree between the driver and every worker.
MUST_MATCH = ("opsched", "ray", "numpy", "gymnasium")


class ClusterError(OpschedError):
    """A cluster that cannot be reached or used (the message says which node or setting)."""


@dataclass(frozen=True)
class ClusterSpec:
    """What ``--cluster`` asked for: the engine (only ``ray``) and an address (None: Ray's default)."""

    engine: str
    address: str | None = None

    def __str__(self) -> str:
        return self.engine if self.address is None else f"{self.engine}:{self.address}"


def parse_cluster(text: str) -> ClusterSpec:
    """``ray`` or ``ray:ADDRESS`` -> ClusterSpec (ClusterError naming the value otherwise)."""
    engine, _, address = str(text).strip().partition(":")
    if engine != "ray":
        raise ClusterError(f"--cluster {text!r}: expected ray or ray:ADDRESS (e.g. ray:10.0.0.5:6379, ray:auto)")
    if _ and not address:
        raise ClusterError(f"--cluster {text!r}: an empty address after 'ray:'")
    return ClusterSpec("ray", address or None)


def require_ray() -> Any:
    """``import ray``, or a ClusterError telling how to install it."""
    try:
        import ray
    except ImportError:
        raise ClusterError(f"--cluster ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def connect(spec: ClusterSpec | str) -> Any:
    """Join the cluster (once per process; a second call reuses the connection) and return the ``ray`` module."""
    spec = parse_cluster(spec) if isinstance(spec, str) else spec
    ray = require_ray()
    if ray.is_initialized():
        return ray
    import logging

    try:
        ray.init(address=spec.address, logging_level=logging.WARNING, log_to_driver=False,
                 include_dashboard=False, configure_logging=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(f"--cluster {spec}: cannot join the Ray cluster: {first}") from None
    return ray


# ------------------------------------------------------------------ machines
def machine_resource(fingerprint: str) -> str:
    """The custom resource a node of the machine ``fingerprint`` offers (``Machine.fingerprint()``)."""
    return f"{RESOURCE_PREFIX}{fingerprint}"


def local_resources() -> dict[str, float]:
    """This host's ``ray start --resources`` entry: one unit of its machine's resource."""
    from opsched.machine import Machine

    return {machine_resource(Machine.probe().fingerprint()): 1.0}


def machines_offered(ray: Any) -> dict[str, int]:
    """Fingerprint -> how many alive nodes offer it (from the nodes' custom resources)."""
    out: dict[str, int] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        for name in node.get("Resources", {}):
            if name.startswith(RESOURCE_PREFIX):
                fp = name[len(RESOURCE_PREFIX):]
                out[fp] = out.get(fp, 0) + 1
    return out


# ---------------------------------------------------------------- describing
def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in MUST_MATCH + ("torch", "stable-baselines3", "sb3-contrib"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def process_record() -> dict[str, Any]:
    """Where this process runs: host, Ray node, pid, Python and package versions (JSON-able)."""
    import os

    record: dict[str, Any] = {"host": platform.node(), "pid": os.getpid(), "python": platform.python_version(),
                              "packages": package_versions()}
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            record["node_id"] = ctx.get_node_id()
            record["node_ip"] = ray.util.get_node_ip_address()
    except ImportError:
        pass
    return record


def check_versions(driver: dict[str, Any], worker: dict[str, Any]) -> None:
    """ClusterError when a worker runs other versions of what the driver and it both execute."""
    for name in MUST_MATCH:
        mine, theirs = driver["packages"].get(name), worker["packages"].get(name)
        if mine != theirs:
            raise ClusterError(f"node {worker.get('node_ip', worker.get('host'))} runs {name} {theirs}, this driver "
                               f"{mine}: install the same versions on every node")
    if driver["python"].rsplit(".", 1)[0] != worker["python"].rsplit(".", 1)[0]:
        raise ClusterError(f"node {worker.get('node_ip', worker.get('host'))} runs Python {worker['python']}, this "
                           f"driver {driver['python']}: use the same Python on every node")


def describe(ray: Any) -> dict[str, Any]:
    """The cluster as a run folder records it: Ray's version, the driver, every node (alive or not) with its
    CPUs and custom resources."""
    nodes = []
    for n in ray.nodes():
        res = dict(n.get("Resources", {}))
        nodes.append({"node_id": n.get("NodeID"), "address": n.get("NodeManagerAddress"),
                      "hostname": n.get("NodeManagerHostname"), "alive": bool(n.get("Alive")),
                      "cpus": res.get("CPU", 0.0), "gpus": res.get("GPU", 0.0),
                      "machines": sorted(k[len(RESOURCE_PREFIX):] for k in res if k.startswith(RESOURCE_PREFIX))})
    return {"engine": "ray", "ray_version": ray.__version__, "driver": process_record(),
            "nodes": nodes, "cpus_total": sum(n["cpus"] for n in nodes if n["alive"])}


def main(argv: list[str] | None = None) -> None:
    """``python -m opsched.agents.cluster resources``: this host's ``ray start --resources`` JSON."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["resources"]:
        sys.exit("usage: python -m opsched.agents.cluster resources   "
                 "(prints the --resources JSON of `ray start` for this machine)")
    print(json.dumps(local_resources()))


if __name__ == "__main__":  # pragma: no cover
    main()
