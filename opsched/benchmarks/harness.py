"""What every benchmark shares: a process per configuration, sub-benchmark runs, the record of where it ran.

* **A process per configuration.**  Eager PyTorch, ``torch.compile``, ONNX
  Runtime and opsched's executor each own thread pools (OpenMP teams, ORT's
  pool, executor threads) that spin or pin; in one process they would fight
  over the same cores.  :class:`Worker` starts a configuration in its own
  process (``python -m opsched.benchmarks.real_worker``), which prepares
  everything once and then answers "time this ``n`` times" requests as JSON
  lines; its stderr goes to a log whose tail is quoted when it fails.
* **Interleaved rounds.**  :func:`time_workers` drives the workers through
  :func:`opsched.timing.interleave`, so a benchmark's timings, their ratios
  (taken within a round) and the load they ran under are measured exactly as
  ``opsched apply`` measures them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opsched.timing import Timings, host_record, interleave, loadavg, settle, summary

#: Distributions whose versions go into every report.
PACKAGES = ("opsched", "torch", "numpy", "onnx", "onnxruntime", "tensorflow-cpu", "tensorflow", "gymnasium",
            "stable-baselines3", "sb3-contrib", "optuna", "scipy", "matplotlib", "rich")
#: Where a benchmark writes its figures unless told otherwise (relative to the working directory).
DEFAULT_OUT = Path("runs") / "bench"


class WorkerError(RuntimeError):
    """A worker failed to start, answered with an error, or ran past its deadline."""


# --------------------------------------------------------------------- environment
def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every benchmark subprocess: glibc kept from
    unmapping large blocks (see ``opsched.backends.torch_cpu.recommended_env``),
    for every configuration alike, and quiet TensorFlow logs."""
    from opsched.backends.torch_cpu import recommended_env

    env = {**os.environ, **recommended_env()}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
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
    """Where the benchmark ran (:func:`opsched.timing.host_record`) and the machine as opsched probes it."""
    desc = host_record()
    try:
        from opsched.machine import Machine

        desc["opsched_machine"] = Machine.probe().to_dict()
    except Exception as exc:
        desc["opsched_machine"] = f"probe failed: {type(exc).__name__}: {exc}"
    return desc


def describe_machine_line(desc: Mapping[str, Any]) -> str:
    m = desc.get("opsched_machine")
    cores = m["devices"][0]["cores"] if isinstance(m, dict) else desc.get("cpu_count")
    return (f"{desc.get('cpu_model', 'CPU')}, {cores} cores used by opsched "
            f"({desc.get('cpu_count')} logical CPUs), {desc.get('platform')}, Python {desc.get('python')}")


def pin_one_core() -> str:
    """Pin this process to its first allowed CPU and its BLAS / OpenMP pools to one
    thread (a figure "per core"); says what was done."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to CPU {cpu}"
    except (AttributeError, OSError) as exc:
        return f"not pinned ({exc})"


@contextlib.contextmanager
def one_core() -> Iterator[str]:
    """:func:`pin_one_core` for one block of a benchmark that goes on after it: the
    process's CPU affinity and its BLAS / OpenMP limits are put back at the end."""
    from threadpoolctl import threadpool_limits

    try:
        affinity = os.sched_getaffinity(0)
    except AttributeError:  # not Linux: nothing to put back
        affinity = None
    with threadpool_limits(1):
        try:
            yield pin_one_core()
        finally:
            if affinity is not None:
                os.sched_setaffinity(0, affinity)


def timed_plan(policy: Any, graph: Any, machine: Any, row: dict[str, Any], tag: str, **options: Any) -> Any:
    """``policy.plan(graph, machine, **options)`` from a cleared heuristics' cache, its CPU
    ms appended to ``row[f"{tag}_ms"]``: how the planning benchmarks that compare search
    variants on the same pairs (budget_free, coarse_budget, rejected, step_cost) time a plan."""
    from opsched.policies.hints import clear_cache

    clear_cache()
    t0 = time.process_time()
    plan = policy.plan(graph, machine, **options)
    row.setdefault(f"{tag}_ms", []).append(1e3 * (time.process_time() - t0))
    return plan


def score_with_greedy(policy: Any, graph: Any, machine: Any, sim: Any, best: float, row: dict[str, Any], tag: str,
                      plan: Any) -> None:
    """``row[f"{tag}_default"]`` and ``row[f"{tag}_greedy"]``: ``plan``'s and the policy's greedy
    decoding's makespans over ``best``, and ``row[f"{tag}_hint"]`` the hint the decoding
    followed (call it inside the variant being measured: the hint may depend on it)."""
    greedy = policy.plan(graph, machine, samples=0, candidates=(), refine=0)
    row[f"{tag}_default"] = sim.makespan(graph, plan) / best
    row[f"{tag}_greedy"] = sim.makespan(graph, greedy) / best
    row[f"{tag}_hint"] = greedy.meta.get("hint")


def doc_summary(doc: str | None, paragraph: bool = False) -> str:
    """A module docstring's first line (``paragraph``: first paragraph) for ``--help``;
    ``""`` without one (``python -OO`` strips docstrings: ``__doc__`` is None)."""
    if not doc:
        return ""
    return doc.split("\n\n")[0] if paragraph else doc.splitlines()[0]


def throughput_args(module: str, doc: str | None, argv: Sequence[str] | None, sizes: Mapping[str, int],
                    quick: Mapping[str, int]) -> Any:
    """The command line of a throughput benchmark: integer options (``sizes``:
    name -> default), ``--quick`` (a smoke run: ``quick``'s values instead) and ``--out``."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m opsched.benchmarks.{module}", description=doc_summary(doc))
    for name, default in sizes.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items()))
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default runs/bench)")
    args = ap.parse_args(argv)
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value)
    return args


def rate_summary(rows: Sequence[Mapping[str, Any]], unit: str, target: float) -> dict[str, Any]:
    """A throughput benchmark's summary: median and minimum of ``rows[unit]``
    (per CPU second) and of ``rows[unit + "_wall"]``, the load, the target met or not."""
    cpu, wall = [r[unit] for r in rows], [r[f"{unit}_wall"] for r in rows]
    med = summary(cpu)["median"]
    return {f"median_{unit}": round(med), f"min_{unit}": min(cpu), f"median_{unit}_wall": round(summary(wall)["median"]),
            f"min_{unit}_wall": min(wall), "load_average_1min": (loadavg() or (math.nan,))[0], f"target_{unit}": target,
            "meets_target_median": med >= target, "meets_target_all": min(cpu) >= target}


def rate_sentence(s: Mapping[str, Any], unit: str, label: str) -> str:
    """The headline of :func:`rate_summary`, ``label`` naming the unit (``ops/s``)."""
    return (f"**Median {s[f'median_{unit}']:,} {label}, minimum {s[f'min_{unit}']:,} {label}** (target "
            f"{s[f'target_{unit}']:,.0f}); wall clock: median {s[f'median_{unit}_wall']:,}, minimum "
            f"{s[f'min_{unit}_wall']:,}; 1-min load average {s['load_average_1min']:.1f}.")


def report_throughput(name: str, title: str, how: str, rows: Sequence[Mapping[str, Any]], unit: str, label: str,
                      target: float, columns: Mapping[str, str], out: Path, **record: Any) -> None:
    """Write a throughput benchmark's ``<name>.json`` and ``.md`` (its
    :func:`rate_summary` first, then a row per case: ``columns`` maps a header to
    a format string over the row; the first two columns are text) and print the headline."""
    summary = rate_summary(rows, unit, target)
    result = {"benchmark": name, "command": f"python -m opsched.benchmarks.{name}", "host": host_record(), **record,
              "summary": summary, "rows": rows}
    lines = [f"# {title}", "", f"`python -m opsched.benchmarks.{name}` -- {how}", "",
             f"{label} counts per second of this process's CPU time (what one core delivers); the wall-clock "
             "figure is lower when the machine is shared.", "", rate_sentence(summary, unit, label), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * 2 + "---:|" * (len(columns) - 2)]
    lines += ["| " + " | ".join(fmt.format(**r) for fmt in columns.values()) + " |" for r in rows]
    md = save_result(out, name, result, "\n".join(lines) + "\n")
    print(f"median {summary[f'median_{unit}']:,} {label} (CPU time), min {summary[f'min_{unit}']:,} -> {md}")


def save_result(out: Path, name: str, result: Mapping[str, Any], markdown: str) -> Path:
    """``out/<name>.json`` and ``out/<name>.md``; returns the markdown file."""
    from opsched.io import atomic_write_text

    atomic_write_text(out / f"{name}.json", json.dumps(result, indent=1, default=str) + "\n")
    atomic_write_text(out / f"{name}.md", markdown)
    return out / f"{name}.md"


def save_figure(fig: Any, path: Path) -> None:
    """Write a matplotlib figure as PNG (atomically) and close it."""
    import io

    import matplotlib.pyplot as plt

    from opsched.io import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


# --------------------------------------------------------------------- processes
def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the process and anything it started (its own process group only)."""
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


def _tail(path: Path, n: int, limit: int) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-limit:]


def run_module(module: str, argv: Sequence[str], timeout: float, log_path: Path,
               env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Run ``python -m module argv...`` in its own process group, output to
    ``log_path``; ``(returncode, tail of the log)``; 124 on timeout."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(env or worker_env()), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = 124
        except BaseException:
            _kill_group(proc)
            raise
    return rc, _tail(log_path, 5, 500)


@dataclass
class Worker:
    """One configuration in its own process, speaking JSON lines.

    ``argv`` are the arguments after ``python -m opsched.benchmarks.real_worker``.
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
            [sys.executable, "-m", "opsched.benchmarks.real_worker", *self.argv],
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
                raise WorkerError(f"{self.name}: worker exited (status {rc}); log: {_tail(self.log_path, 6, 600)}")
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
            raise WorkerError(f"{self.name}: worker is gone ({exc}); log: {_tail(self.log_path, 6, 600)}") from None
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


def start_all(workers: Sequence[Worker], timeout: float, alone: Collection[str] = ()) -> dict[str, str]:
    """Start every worker and wait for each to be ready (they prepare in
    parallel); returns ``{name: reason}`` for those that failed, closed.

    The workers named in ``alone`` prepare one at a time after all the others
    are ready (idle): their set-up measures this machine -- ``opsched.train_step``
    times its candidate plans, checks for busy cores and decides whether to
    fall back to eager -- and beside nine other processes capturing and
    planning it saw a busy core, planned for one thread and fell back (measured:
    inception, load average 7 during its set-up)."""
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout

    def start(batch: Sequence[Worker]) -> None:
        for w in batch:
            try:
                w.start()
            except OSError as exc:
                failed[w.name] = f"could not start: {exc}"
        for w in batch:
            if w.name in failed:
                continue
            try:
                w.wait_ready(max(1.0, deadline - time.monotonic()))
            except WorkerError as exc:
                failed[w.name] = str(exc)
                w.close(kill=True)

    start([w for w in workers if w.name not in alone])
    for w in workers:
        if w.name in alone:
            start([w])
    return failed


def time_workers(configs: Sequence[tuple[str, Worker, str]], rounds: int, iters: int, warmup: int,
                 timeout: float, settle_s: float = 0.0, on_step: Callable[[str], None] | None = None,
                 target_s: float = 0.0) -> tuple[Timings, dict[str, str]]:
    """Warm up, then time every ``(label, worker, config)`` with
    :func:`opsched.timing.interleave` (one sample per round: the median of that
    round's calls).

    A configuration that fails is dropped with its reason in the second value.
    Before each request the driver waits until every worker's threads have gone
    quiet (:func:`opsched.timing.settle` over the workers' pids: measured, not
    a guessed pause), so a pool that spins after its work (OpenMP, ONNX
    Runtime: about 45 ms here) does not take the cores of the next
    configuration timed - with a fixed 20 ms pause the configuration timed
    after ONNX Runtime's parallel mode (opsched on ``ort``) ran 1.3-2.3x slower
    than the same session measured alone.  ``settle_s``: a further fixed pause.
    With ``target_s`` > 0 a configuration gets only as many calls per round (at
    least 1, at most ``iters``) as fit in ``target_s`` by its warm-up speed, so
    slow configurations do not dominate the run's length."""
    failed: dict[str, str] = {}
    n_calls: dict[str, int] = {}

    pids = sorted({w.proc.pid for _, w, _ in configs if w.proc is not None})

    def call(label: str, worker: Worker, config: str, n: int) -> float:
        if label in failed:
            return float("nan")
        settle(pids)
        if settle_s > 0:
            time.sleep(settle_s)
        try:
            med = summary(worker.time(config, n, timeout))["median"]
        except WorkerError as exc:
            failed[label] = str(exc)
            med = float("nan")
        if on_step is not None:
            on_step(label)
        return med

    for label, worker, config in configs:  # warm-up: also sizes the calls per round
        t = call(label, worker, config, max(1, warmup))
        n_calls[label] = int(min(iters, max(1, target_s // max(t, 1e-9)))) if target_s > 0 and math.isfinite(t) else iters
    fns = {label: (lambda a=label, w=worker, c=config: call(a, w, c, n_calls[a])) for label, worker, config in configs}
    timings = interleave(fns, warmup=0, repeats=rounds, pids=pids, quiet=False)  # call() settles
    for label in failed:
        timings.samples.pop(label, None)
    return timings, failed


# --------------------------------------------------------------------- progress
def progress_bar(console: Any = None, disable: bool = False) -> Any:
    """:func:`opsched.progress.progress_bar` with a ``detail`` field (the current configuration)."""
    from opsched.progress import progress_bar as bar

    return bar(console=console, enabled=not disable, fields=("detail",))


def fmt_ratio(s: Mapping[str, float] | None, digits: int = 2) -> str:
    """``0.83 (0.80-0.86)``: median with the interquartile range."""
    if not s or not s.get("n"):
        return "—"
    med, q1, q3 = s["median"], s["q1"], s["q3"]
    return f"{med:.{digits}f} ({q1:.{digits}f}–{q3:.{digits}f})"
