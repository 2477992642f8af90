"""Shared timing helpers for ``bench/run_all.py``: workers, interleaving, statistics.

Why these pieces exist:

* **A process per configuration.**  Eager PyTorch, ``torch.compile``, ONNX
  Runtime and opsched's executor each own thread pools (OpenMP teams, ORT's
  pool, executor threads) that spin or pin; in one process they would fight
  over the same two cores.  :class:`Worker` starts a configuration in its own
  process (``bench/configs/real_worker.py``), which prepares everything once
  and then answers "time this ``n`` times" requests as JSON lines.  The
  protocol goes through a duplicate of the worker's stdout, so whatever the
  libraries print cannot corrupt it; their stderr goes to a log file whose
  tail is quoted when a worker fails.
* **Interleaving.**  :func:`interleave` warms every configuration up, then
  runs rounds that visit all of them, starting one further along each round,
  so drift on a shared machine hits them alike.  A ratio is taken *within*
  each round (configuration / reference of that round) and then summarised,
  so two configurations are only ever compared on neighbouring measurements.
* **Medians with the spread.**  :func:`stats` gives the median with the
  quartiles and extremes; nothing is reported as a single number without them.
"""

from __future__ import annotations

import json
import math
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WORKER_SCRIPT = BENCH_DIR / "configs" / "real_worker.py"

#: Distributions whose versions go into every report.
PACKAGES = ("opsched", "torch", "numpy", "onnx", "onnxruntime", "tensorflow-cpu", "tensorflow", "gymnasium",
            "stable-baselines3", "sb3-contrib", "optuna", "scipy", "matplotlib", "rich")


class WorkerError(RuntimeError):
    """A worker failed to start, answered with an error, or ran past its deadline."""


# --------------------------------------------------------------------- statistics
def stats(xs: Iterable[float]) -> dict[str, float]:
    """Median, quartiles, extremes and count of ``xs`` (NaNs dropped)."""
    a = np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=float)
    if a.size == 0:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "min": float("nan"),
                "max": float("nan"), "n": 0}
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "min": float(a.min()),
            "max": float(a.max()), "n": int(a.size)}


def geomean(xs: Iterable[float]) -> float:
    vals = [x for x in xs if x is not None and math.isfinite(x) and x > 0]
    return float(math.exp(sum(math.log(x) for x in vals) / len(vals))) if vals else float("nan")


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    if len(x) < 3:
        return float("nan")
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


def round_ratios(samples: Mapping[str, Sequence[float]], ref: str) -> dict[str, dict[str, float]]:
    """Per configuration, the stats of ``sample[r] / samples[ref][r]`` over rounds ``r``.

    ``samples[name][r]`` is the configuration's median time in round ``r``;
    taking the ratio inside a round compares only neighbouring measurements."""
    base = samples.get(ref) or []
    out = {}
    for name, xs in samples.items():
        rs = [x / b for x, b in zip(xs, base) if b and b > 0 and x and math.isfinite(x)]
        out[name] = stats(rs)
    return out


# --------------------------------------------------------------------- environment
def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every benchmark subprocess: glibc kept from
    unmapping large blocks (see ``opsched.backends.torch_cpu.recommended_env``),
    for every configuration alike, and quiet TensorFlow logs."""
    env = dict(os.environ)
    try:
        from opsched.backends.torch_cpu import recommended_env

        env.update(recommended_env())
    except Exception:  # the runtime is another engineer's module: keep going without it
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 1024 * 1024))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1024 * 1024 * 1024))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine_description() -> dict[str, Any]:
    """The probed machine (as opsched sees it) and what the OS says about it."""
    desc: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        desc["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                desc["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from opsched.machine import Machine

        desc["opsched_machine"] = Machine.probe().to_dict()
    except Exception as exc:
        desc["opsched_machine"] = f"probe failed: {type(exc).__name__}: {exc}"
    desc["loadavg"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return desc


def describe_machine_line(desc: Mapping[str, Any]) -> str:
    m = desc.get("opsched_machine")
    cores = m["devices"][0]["cores"] if isinstance(m, dict) else desc.get("cpu_count")
    return (f"{desc.get('cpu_model', platform.processor() or 'CPU')}, {cores} cores used by opsched "
            f"({desc.get('cpu_count')} logical CPUs), {desc.get('platform')}, Python {desc.get('python')}")


# --------------------------------------------------------------------- workers
def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the worker and anything it started (its own process group only)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class Worker:
    """One configuration in its own process, speaking JSON lines.

    ``argv`` are the arguments after ``python bench/configs/real_worker.py``.
    The worker prints one ``{"ready": ...}`` line once prepared, then answers
    each request line; ``{"error": ...}`` at any point fails it."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    info: dict[str, Any] = field(default_factory=dict)
    _lines: queue.Queue = field(default_factory=queue.Queue)
    _log: Any = None

    def start(self) -> Worker:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), *self.argv], cwd=str(REPO),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=self.env or worker_env(), start_new_session=True, text=True, bufsize=1,
        )
        threading.Thread(target=self._pump, name=f"bench-{self.name}", daemon=True).start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF

    def _log_tail(self, n: int = 6) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])[-600:]

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                raise WorkerError(f"{self.name}: no answer within {timeout:.0f} s")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                rc = self.proc.wait() if self.proc else None
                raise WorkerError(f"{self.name}: worker exited (status {rc}); log: {self._log_tail()}")
            line = line.strip()
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "error" in msg:
                self.close(kill=True)
                raise WorkerError(f"{self.name}: {msg['error']}")
            return msg

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        self.info = self._read(timeout)
        return self.info

    def request(self, msg: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None or self.proc.stdin is None:
            raise WorkerError(f"{self.name}: worker is not running")
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"{self.name}: worker is gone ({exc}); log: {self._log_tail()}") from None
        return self._read(timeout)

    def time(self, config: str, iters: int, timeout: float) -> list[float]:
        """Seconds per call of ``config`` (a name the worker prepared), ``iters`` calls."""
        return [float(x) for x in self.request({"cmd": "time", "name": config, "iters": iters}, timeout)["times"]]

    def close(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if not kill and self.proc.stdin is not None:
                try:
                    self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    self.proc.stdin.flush()
                    self.proc.wait(timeout=20)
                except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                    pass
            _kill_group(self.proc)
        if self._log is not None:
            self._log.close()
            self._log = None


def start_all(workers: Sequence[Worker], timeout: float, on_ready: Callable[[Worker], None] | None = None
              ) -> dict[str, str]:
    """Start every worker and wait for each to be ready (they prepare in
    parallel); returns ``{name: reason}`` for those that failed, closed."""
    failed: dict[str, str] = {}
    for w in workers:
        try:
            w.start()
        except OSError as exc:
            failed[w.name] = f"could not start: {exc}"
    deadline = time.monotonic() + timeout
    for w in workers:
        if w.name in failed:
            continue
        try:
            w.wait_ready(max(1.0, deadline - time.monotonic()))
        except WorkerError as exc:
            failed[w.name] = str(exc)
            w.close(kill=True)
        if on_ready is not None:
            on_ready(w)
    return failed


def interleave(configs: Sequence[tuple[str, Worker, str]], rounds: int, iters: int, warmup: int,
               timeout: float, settle_s: float = 0.02, on_step: Callable[[str], None] | None = None,
               target_s: float = 0.0) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Warm up, then time every ``(label, worker, config)`` in interleaved rounds.

    Returns ``(samples, failed)``: ``samples[label][r]`` is the median of the
    calls of round ``r``; a configuration that fails is dropped from then on
    with its reason in ``failed``.  Each round starts one configuration
    further along, and ``settle_s`` passes between configurations so a pool
    that spins after its work (OpenMP, ONNX Runtime) has gone quiet before the
    next one is timed.  With ``target_s`` > 0 a configuration gets only as
    many calls per round (at least 1, at most ``iters``) as fit in
    ``target_s`` by its warm-up speed, so slow configurations do not
    dominate the run's length."""
    samples: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    failed: dict[str, str] = {}
    n_calls: dict[str, int] = {label: iters for label, _, _ in configs}

    def one(label: str, worker: Worker, config: str, n: int) -> list[float] | None:
        if label in failed:
            return None
        try:
            return worker.time(config, n, timeout)
        except WorkerError as exc:
            failed[label] = str(exc)
            return None

    for label, worker, config in configs:
        ts = one(label, worker, config, max(1, warmup))
        if ts and target_s > 0:
            n_calls[label] = int(min(iters, max(1, target_s // max(float(np.median(ts)), 1e-9))))
        if on_step:
            on_step(label)
    k = len(configs)
    for r in range(rounds):
        for j in range(k):
            label, worker, config = configs[(r + j) % k]
            time.sleep(settle_s)
            ts = one(label, worker, config, n_calls[label])
            if ts:
                samples[label].append(float(np.median(ts)))
            if on_step:
                on_step(label)
    for label in failed:
        samples.pop(label, None)
    return samples, failed


def run_script(argv: Sequence[str], timeout: float, log_path: Path, env: Mapping[str, str] | None = None
               ) -> tuple[int, str]:
    """Run ``python argv...`` from the repository root in its own process group,
    output to ``log_path``; ``(returncode, tail of the log)``; 124 on timeout."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *argv], cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(env or worker_env()), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = 124
        except BaseException:
            _kill_group(proc)
            raise
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    return rc, " | ".join(lines[-5:])[-500:]


# --------------------------------------------------------------------- progress
def progress_bar(console: Any = None, disable: bool = False) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, disable=disable, transient=False)


def fmt_ratio(s: Mapping[str, float] | None, digits: int = 2) -> str:
    """``0.83 (0.80-0.86)``: median with the interquartile range."""
    if not s or not s.get("n"):
        return "—"
    med, q1, q3 = s["median"], s["q1"], s["q3"]
    return f"{med:.{digits}f} ({q1:.{digits}f}–{q3:.{digits}f})"
