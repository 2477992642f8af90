"""A throw-away Ray cluster on this host, on loopback: for the tests, the benchmark and trying things out.

``LocalRayCluster`` starts a head node and any number of worker nodes as
``ray start --block`` processes, each in its own process group, bound to
127.0.0.1 with free ports and a private temporary directory, and stops
exactly those processes (never ``ray stop``, which ends every Ray process of
the host, other users' included).  A node can be pinned to some CPUs
(``taskset``-style affinity, inherited by its workers): opsched probes the
machine affinity-aware, so such a node is a machine of its own, with its own
fingerprint - how one host stands in for a cluster of different machines.

    with LocalRayCluster(head_cpus=2, workers=[NodeSpec(cpus=1, affinity=[0])]) as cluster:
        opsched train-policy --cluster ray:{cluster.address} ...

Ray replaces ``127.0.0.1`` / ``localhost`` as a node address by the host's
remotely reachable one (and its switch against that refuses multi-node
clusters), but takes any other loopback address as given: the head is
``127.0.0.2``, worker node ``k`` is ``127.0.0.{3+k}``, so every node, and a
driver joining ``cluster.address``, talks over loopback only.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The nodes' environment: no usage statistics sent anywhere; a dead node noticed within seconds
#: (Ray's health checks: every second, three misses), not the default quarter of a minute.
NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "1000",
            "RAY_health_check_failure_threshold": "3", "RAY_health_check_timeout_ms": "1000"}
HEAD_IP = "127.0.0.2"


def node_ip(index: int) -> str:
    """The loopback address of node ``index`` (0: the head)."""
    return f"127.0.0.{2 + index}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class NodeSpec:
    """One node: CPUs Ray may schedule, custom resources, and the CPUs its processes may run on (None: all)."""

    cpus: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    affinity: list[int] | None = None


class LocalRayCluster:
    """Head (``head_cpus``, ``head_resources``) plus ``workers``; a context manager (see the module docstring).
    ``env``: more environment for the nodes (Ray's ``RAY_*`` system settings)."""

    def __init__(self, head_cpus: int = 2, workers: list[NodeSpec] | None = None,
                 head_resources: dict[str, float] | None = None, head_affinity: list[int] | None = None,
                 object_store_mb: int = 100, env: dict[str, str] | None = None) -> None:
        self.env = {**NODE_ENV, **(env or {})}
        self.head = NodeSpec(head_cpus, dict(head_resources or {}), head_affinity)
        self.worker_specs = list(workers or [])
        self.object_store_mb = int(object_store_mb)
        self.procs: list[subprocess.Popen] = []
        self.port = 0
        self.tmp: Path | None = None

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.port}"

    def _ray(self) -> str:
        exe = Path(sys.executable).with_name("ray")
        return str(exe) if exe.exists() else "ray"

    def _start_node(self, spec: NodeSpec, index: int) -> subprocess.Popen:
        import json

        head, name = index == 0, "head" if index == 0 else f"worker{index - 1}"
        args = [self._ray(), "start", "--block", "--node-ip-address", node_ip(index), "--num-cpus", str(spec.cpus),
                "--num-gpus", "0", "--object-store-memory", str(self.object_store_mb * 1024 * 1024),
                "--disable-usage-stats", "--dashboard-agent-listen-port", str(free_port()),
                "--dashboard-agent-grpc-port", str(free_port()), "--metrics-export-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port())]
        if spec.resources:
            args += ["--resources", json.dumps(spec.resources)]
        if head:
            args += ["--head", "--port", str(self.port), "--include-dashboard", "false",
                     "--ray-client-server-port", str(free_port()), "--temp-dir", str(self.tmp)]
        else:
            args += ["--address", self.address]
        assert self.tmp is not None
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 (kept open for the node's life)
        affinity = spec.affinity

        def pin() -> None:
            if affinity is not None:
                os.sched_setaffinity(0, affinity)

        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **self.env}, preexec_fn=pin)
        self.procs.append(proc)
        return proc

    def start(self, timeout_s: float = 90.0) -> LocalRayCluster:
        self.tmp = Path(tempfile.mkdtemp(prefix="opray", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
        self.port = free_port()
        try:
            self._start_node(self.head, 0)
            self._wait_nodes(1, timeout_s)
            for k, spec in enumerate(self.worker_specs):
                self._start_node(spec, 1 + k)
            self._wait_nodes(1 + len(self.worker_specs), timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_nodes(self, n: int, timeout_s: float) -> None:
        """Until ``n`` nodes are alive (asked with ``ray status`` in a subprocess: no driver here)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Ray node exited with {p.returncode}: {self.log_tail()}")
            out = subprocess.run([self._ray(), "status", "--address", self.address], capture_output=True, text=True,
                                 env={**os.environ, **NODE_ENV}, timeout=60)
            if out.returncode == 0 and _active_nodes(out.stdout) >= n:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the local Ray cluster did not bring up {n} node(s) in {timeout_s:.0f} s: {self.log_tail()}")

    def kill_node(self, index: int) -> None:
        """Kill worker node ``index`` (0-based, the head excluded) and all its processes: a lost node."""
        _kill_session(self.procs[1 + index], signal.SIGKILL)

    def log_tail(self, n: int = 2000) -> str:
        if self.tmp is None:
            return ""
        texts = [p.read_text(errors="replace")[-n:] for p in sorted(self.tmp.glob("*.log"))]
        return " | ".join(t.strip().replace("\n", " / ") for t in texts)

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM to every node's process group, SIGKILL to what is left after ``grace_s``."""
        for proc in reversed(self.procs):
            _kill_session(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_session(proc, signal.SIGKILL)  # the node's raylet, agents and workers too
            proc.wait(timeout=10)
        self.procs = []
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _kill_session(proc: subprocess.Popen, sig: int) -> None:
    """Signal every process of the session ``proc`` leads: a node's ``ray start`` and all it started
    (Ray's workers put themselves in process groups of their own, but stay in the session)."""
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _session_members(sid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm)": state ppid pgrp session ...
        if len(fields) > 3 and int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


def _active_nodes(status: str) -> int:
    """Active nodes in ``ray status`` output (the lines after 'Active:' up to 'Pending:')."""
    lines = status.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Active:")
    except StopIteration:
        return 0
    count = 0
    for line in lines[start + 1:]:
        if line.strip().endswith(":"):
            break
        count += "node_" in line
    return count
