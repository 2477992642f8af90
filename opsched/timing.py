"""Timing real runs on a shared machine: warm up, interleave, medians, and the load they ran under.

Every real timing in opsched (``opsched apply``, ``opsched compare`` on a real
backend, the benchmarks) goes through :func:`interleave`: ``warmup`` untimed
calls of each configuration, then ``repeats`` rounds that call every
configuration once, starting one further along each round, so drift on a
shared machine hits them alike.  Each round records how many cores *other*
processes used meanwhile (:class:`ContentionMeter`), so a result can say it
was measured under load instead of printing a speed-up that is noise.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A round during which other processes used more than this many cores (on
#: average) is *loaded*; a result with loaded rounds in the majority says so.
LOADED_CORES = 0.3


class ContentionMeter:
    """How many cores *other* processes used while we measured.

    All CPUs' busy time (:func:`psutil.cpu_times`) minus this process's
    (:meth:`psutil.Process.cpu_times`) over the measurement gives the other
    processes' load.  ``children=True`` also counts this process's children
    that ended and were waited for during the measurement as ours; ``pids``:
    other live processes that work for us (a backend's worker processes).
    Reads 0 where psutil cannot read the counters."""

    def __init__(self, children: bool = False, pids: Iterable[int] = ()) -> None:
        self.children = children
        self.pids = tuple(pids)
        self.others_cores = 0.0

    def _seconds(self) -> tuple[float, float] | None:
        import psutil

        try:
            t = psutil.cpu_times()
            busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)  # steal counts: another VM ran
            me = psutil.Process().cpu_times()
            own = me.user + me.system + ((me.children_user + me.children_system) if self.children else 0.0)
        except (psutil.Error, OSError):
            return None
        for pid in self.pids:
            try:
                w = psutil.Process(pid).cpu_times()
                own += w.user + w.system
            except (psutil.Error, OSError):
                pass  # a worker that ended: its time is gone from both counts alike
        return busy, own

    def __enter__(self) -> ContentionMeter:
        self._t0, self._j0 = time.perf_counter(), self._seconds()
        self.others_cores = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        j1, wall = self._seconds(), time.perf_counter() - self._t0
        if self._j0 is None or j1 is None or wall <= 0:
            return
        others = (j1[0] - self._j0[0]) - (j1[1] - self._j0[1])
        self.others_cores = max(0.0, others / wall)


#: :func:`settle` polls in windows of this length, and calls the process quiet when its
#: other threads used less than :data:`QUIET_SHARE` of one core over two windows in a row.
SETTLE_WINDOW_S, QUIET_SHARE = 0.002, 0.1
#: The longest :func:`settle` waits (a process whose threads never sleep, e.g. a busy worker pool).
SETTLE_MAX_S = 1.0


def settle(pids: Sequence[int] = (), max_wait_s: float = SETTLE_MAX_S) -> float:
    """Wait until the threads this process started, and the processes ``pids``, stop using the CPU;
    return the seconds waited.

    Runtimes leave threads spinning after a call: ONNX Runtime's intra-op
    pools spin about 45 ms on this VM, OpenMP's teams for ``KMP_BLOCKTIME`` /
    ``GOMP_SPINCOUNT``, TensorFlow's Eigen pools a while.  A configuration timed
    while the previous one's threads still spin loses the cores to them (the
    ``ort`` rows of ``opsched apply`` read 1.36x where there was nothing).  So
    rather than pausing for a guessed gap, this measures: it sleeps in short
    windows and reads this process's CPU time (every thread but the sleeping
    caller) and each pid's, and returns once two windows in a row used less
    than :data:`QUIET_SHARE` of a core -- the spin, measured, then gone."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except (psutil.Error, OSError):
            pass

    def used() -> float:
        total = time.process_time()
        for pr in procs:
            try:
                c = pr.cpu_times()
                total += c.user + c.system
            except (psutil.Error, OSError):
                pass
        return total

    t0 = time.perf_counter()
    quiet, last = 0, used()
    while quiet < 2 and time.perf_counter() - t0 < max_wait_s:
        w0 = time.perf_counter()
        time.sleep(SETTLE_WINDOW_S)
        now = used()
        busy = (now - last) / max(time.perf_counter() - w0, 1e-9)
        last = now
        quiet = quiet + 1 if busy < QUIET_SHARE else 0
    return time.perf_counter() - t0


def wait_quiet(max_wait_s: float, limit: float = LOADED_CORES, window_s: float = 1.0, windows: int = 1,
               on_wait: Callable[[float], None] | None = None) -> float:
    """Wait until other processes use at most ``limit`` cores over ``windows``
    measurement windows of ``window_s`` in a row, or ``max_wait_s`` has passed;
    returns the cores they used in the last window.  ``on_wait(others)`` is
    called after each window that does not end the wait (progress messages).

    For re-taking a sample measured under load: measuring again at once would
    most likely meet the same burst."""
    deadline, quiet = time.monotonic() + max_wait_s, 0
    while True:
        with ContentionMeter() as meter:
            time.sleep(window_s)
        quiet = quiet + 1 if meter.others_cores <= limit else 0
        if quiet >= windows or time.monotonic() >= deadline:
            return meter.others_cores
        if on_wait is not None:
            on_wait(meter.others_cores)


def loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def cpu_topology() -> tuple[int, int, int, str]:
    """(usable logical CPUs, usable physical cores, sockets, model name).

    The one reader of ``/proc/cpuinfo`` (psutil counts cores but does not say
    which core of which socket a CPU is, which the affinity-aware count needs)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    model = platform.processor() or "cpu"
    cores: set[tuple[str, str]] = set()
    sockets: set[str] = set()
    try:
        blocks = Path("/proc/cpuinfo").read_text().strip().split("\n\n")
        for block in blocks:
            info = dict(
                (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in block.splitlines())
            )
            if int(info.get("processor", -1)) not in allowed:
                continue
            model = info.get("model name", model)
            phys = info.get("physical id", "0")
            sockets.add(phys)
            cores.add((phys, info.get("core id", info.get("processor", "0"))))
    except (OSError, ValueError):
        pass
    physical = len(cores) or len(allowed)
    return len(allowed), physical, max(1, len(sockets)), model


def cpu_model() -> str:
    """The CPU's model name as the OS reports it (``/proc/cpuinfo``), else ``platform.processor()``."""
    return cpu_topology()[3]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), else the CPU count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_record() -> dict[str, Any]:
    """Where a measurement was taken: platform, CPU count and load average now."""
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "loadavg": loadavg(),
            "cpu_model": cpu_model(), "usable_cpus": usable_cpus()}


def summary(xs: Iterable[float]) -> dict[str, float]:
    """Median, quartiles, extremes and count of ``xs`` (non-finite values dropped;
    NaN for an empty sample, never a warning)."""
    a = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not a:
        nan = float("nan")
        return {"median": nan, "q1": nan, "q3": nan, "min": nan, "max": nan, "n": 0}
    q = statistics.quantiles(a, n=4, method="inclusive") if len(a) > 1 else [a[0]] * 3
    return {"median": float(statistics.median(a)), "q1": float(q[0]), "q3": float(q[2]), "min": float(a[0]),
            "max": float(a[-1]), "n": len(a)}


def geomean(xs: Iterable[float]) -> float:
    """Geometric mean of the positive finite values of ``xs`` (NaN when there are none)."""
    vals = [x for x in xs if x is not None and math.isfinite(x) and x > 0]
    return float(math.exp(sum(math.log(x) for x in vals) / len(vals))) if vals else float("nan")


@dataclass
class Timings:
    """Seconds per call of each configuration, and the load of each round."""

    samples: dict[str, list[float]]
    others_cores: list[float] = field(default_factory=list)   # per round
    #: per configuration, the seconds :func:`settle` waited before each of its timed calls
    settle_s: dict[str, list[float]] = field(default_factory=dict)
    loadavg_start: tuple[float, float, float] | None = None
    loadavg_end: tuple[float, float, float] | None = None

    def median(self, name: str) -> float:
        return float(statistics.median(self.samples[name]))

    def stats(self, name: str) -> dict[str, float]:
        return summary(self.samples[name])

    def ratios(self, ref: str) -> dict[str, dict[str, float]]:
        """Per configuration, the :func:`summary` of its time over ``ref``'s, taken
        round by round (so two configurations are compared only on neighbouring
        measurements); a round where either has no finite time is left out."""
        base = self.samples.get(ref, [])
        return {name: summary(x / b for x, b in zip(xs, base) if b > 0 and math.isfinite(b) and math.isfinite(x))
                for name, xs in self.samples.items()}

    @property
    def loaded_rounds(self) -> int:
        return sum(c > LOADED_CORES for c in self.others_cores)

    @property
    def loaded(self) -> bool:
        """Most rounds ran while other processes used the cores: the figures are not to be trusted."""
        return bool(self.others_cores) and self.loaded_rounds * 2 > len(self.others_cores)

    def load_record(self) -> dict[str, Any]:
        """JSON-ready: the load the timings ran under."""
        s = summary(self.others_cores)
        return {"others_cores_median": s["median"], "others_cores_max": s["max"],
                "loaded_rounds": self.loaded_rounds, "rounds": len(self.others_cores), "loaded": self.loaded,
                "loadavg_start": self.loadavg_start, "loadavg_end": self.loadavg_end}

    def warning(self) -> str | None:
        """A sentence for the user when other processes used the cores, else None."""
        if not self.loaded_rounds:
            return None
        s = summary(self.others_cores)
        what = "most" if self.loaded else "some"
        return (f"other processes used the cores during {what} timing rounds ({self.loaded_rounds} of "
                f"{len(self.others_cores)}; median {s['median']:.2f}, max {s['max']:.2f} cores): "
                + ("these timings are not reliable - measure again on a quieter machine" if self.loaded
                   else "the medians should still hold"))


def interleave(configs: Mapping[str, Callable[[], float]], warmup: int = 2, repeats: int = 10, *,
               pids: Sequence[int] = (), on_call: Callable[[int, int], None] | None = None,
               quiet: bool = True) -> Timings:
    """Time every configuration (a callable returning the seconds of one call,
    measured however its runtime measures it): ``warmup`` untimed calls each,
    then ``repeats`` rounds round-robin, rotated by one each round.

    ``quiet``: before every timed call, wait until the threads of the call
    before have gone quiet (:func:`settle`; the waits are recorded in
    ``Timings.settle_s``), so no configuration is timed against another's
    spinning threads.  ``pids``: worker processes the configurations run in
    (their CPU time is not counted as other processes' load, and counts as
    ours for :func:`settle`).  ``on_call(done, total)`` after every call,
    warm-up calls included: progress bars."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"interleave: warmup must be >= 0 and repeats >= 1, got {warmup}, {repeats}")
    names = list(configs)
    out = Timings({k: [] for k in names}, loadavg_start=loadavg())
    total, done = len(names) * (warmup + repeats), 0
    for name in names:
        for _ in range(warmup):
            configs[name]()
            done += 1
            if on_call is not None:
                on_call(done, total)
    for k in range(repeats):
        with ContentionMeter(children=True, pids=pids) as meter:
            for j in range(len(names)):
                name = names[(j + k) % len(names)]
                if quiet:
                    out.settle_s.setdefault(name, []).append(settle(pids))
                out.samples[name].append(float(configs[name]()))
                done += 1
                if on_call is not None:
                    on_call(done, total)
        out.others_cores.append(meter.others_cores)
    out.loadavg_end = loadavg()
    return out


@dataclass
class Clocked:
    """Per call: this process's CPU seconds (all its threads), wall seconds, and the return value."""

    cpu_s: list[float]
    wall_s: list[float]
    results: list[Any]

    def per_second(self, units: float) -> dict[str, float]:
        """Median ``units`` per second of CPU time and of wall time (``cpu``, ``wall``)."""
        return {"cpu": summary(units / max(c, 1e-12) for c in self.cpu_s)["median"],
                "wall": summary(units / max(w, 1e-12) for w in self.wall_s)["median"]}


def clocked(fn: Callable[..., Any], repeats: int, warmup: int = 0,
            setup: Callable[[], Any] | None = None) -> Clocked:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times, recording each
    call's CPU time of this process (what it cost, whatever else shares the
    machine) and wall time.  With ``setup``, each call is ``fn(setup())`` and
    ``setup`` is not timed (a fresh input per call)."""
    def once() -> Any:
        return fn(setup()) if setup is not None else fn()

    for _ in range(warmup):
        once()
    out = Clocked([], [], [])
    for _ in range(repeats):
        arg = setup() if setup is not None else None
        c0, t0 = time.process_time(), time.perf_counter()
        r = fn(arg) if setup is not None else fn()
        t1, c1 = time.perf_counter(), time.process_time()
        out.cpu_s.append(c1 - c0)
        out.wall_s.append(t1 - t0)
        out.results.append(r)
    return out


def wall_clock(fn: Callable[[], Any]) -> Callable[[], float]:
    """``fn`` as a configuration for :func:`interleave`: its wall seconds per call."""
    def once() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return once


__all__ = ["LOADED_CORES", "Clocked", "ContentionMeter", "Timings", "clocked", "cpu_model", "geomean",
           "host_record", "interleave", "loadavg", "settle", "summary", "usable_cpus", "wait_quiet", "wall_clock"]
