"""Traces: what happened when a plan ran (simulated or measured)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opsched.graph import OP_KINDS, OpGraph


@dataclass(frozen=True)
class TraceEvent:
    """One op's execution: times in seconds from the start of the run."""

    op: str
    start: float
    end: float
    device: str
    threads: int
    cores: tuple[int, ...] | None = None  # the slots it ran on, where known
    lane: int | None = None  # the executor / stream that ran it, where known

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Trace:
    events: tuple[TraceEvent, ...]
    backend: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        """From the first start to the last end (seconds); a backend may record
        a measured wall time in ``meta['wall_s']`` as well."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(0.0, min(e.start for e in self.events))

    def by_op(self) -> dict[str, TraceEvent]:
        return {e.op: e for e in self.events}

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "meta": dict(self.meta), "makespan": self.makespan,
                "events": [asdict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trace:
        events = tuple(
            TraceEvent(**{**e, "cores": tuple(e["cores"]) if e.get("cores") is not None else None})
            for e in data["events"]
        )
        return cls(events, data.get("backend", ""), data.get("meta", {}))

    def save(self, path: str | Path) -> None:
        from opsched.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    def critical_path(self, graph: OpGraph) -> list[str]:
        """The chain that determined the makespan: from the last op to finish,
        repeatedly step to the predecessor that finished last."""
        ev = self.by_op()
        if not ev:
            return []
        cur = max(ev.values(), key=lambda e: e.end).op
        path = [cur]
        while True:
            preds = [p for p in graph.predecessors(cur) if p in ev]
            if not preds:
                break
            cur = max(preds, key=lambda p: ev[p].end)
            path.append(cur)
        return path[::-1]

    def lanes(self) -> list[list[TraceEvent]]:
        """Rows for a Gantt chart: one per core when cores are known, else events
        packed greedily into non-overlapping lanes (per device)."""
        rows: dict[tuple[str, int], list[TraceEvent]] = {}
        if self.events and all(e.cores for e in self.events):
            for e in self.events:
                for c in e.cores or ():
                    rows.setdefault((e.device, c), []).append(e)
            return [sorted(rows[k], key=lambda e: e.start) for k in sorted(rows)]
        ends: dict[str, list[float]] = {}
        for e in sorted(self.events, key=lambda e: (e.start, e.end)):
            lane_ends = ends.setdefault(e.device, [])
            for i, end in enumerate(lane_ends):
                if end <= e.start + 1e-12:
                    lane_ends[i] = e.end
                    rows.setdefault((e.device, i), []).append(e)
                    break
            else:
                lane_ends.append(e.end)
                rows.setdefault((e.device, len(lane_ends) - 1), []).append(e)
        return [rows[k] for k in sorted(rows)]

    def plot(self, path: str | Path, graph: OpGraph | None = None, title: str | None = None,
             max_rows: int = 80) -> Path:
        """Draw a Gantt chart to ``path`` (PNG): one row per core or lane, ops
        coloured by kind, the critical path outlined in black."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        rows = self.lanes()[:max_rows]
        kinds = {op.id: op.kind for op in graph.ops} if graph is not None else {}
        crit = set(self.critical_path(graph)) if graph is not None else set()
        cmap = plt.get_cmap("tab20")
        colour = {k: cmap(i % 20) for i, k in enumerate(OP_KINDS)}
        scale, unit = _time_unit(self.makespan)
        fig_h = max(2.5, 0.25 * len(rows) + 1.5)
        fig, ax = plt.subplots(figsize=(11, fig_h))
        for r, row in enumerate(rows):
            for e in row:
                on_crit = e.op in crit
                ax.barh(r, (e.end - e.start) * scale, left=e.start * scale, height=0.8,
                        color=colour.get(kinds.get(e.op, "other")),
                        edgecolor="black" if on_crit else "none", linewidth=1.2 if on_crit else 0)
        ax.set_yticks(range(len(rows)))
        labels = []
        for row in rows:
            e = row[0]
            labels.append(f"{e.device}" + (f" c{e.cores[0]}" if e.cores else ""))
        ax.set_yticklabels(labels, fontsize=6 if len(rows) > 30 else 8)
        ax.invert_yaxis()
        ax.set_xlabel(f"time ({unit})")
        ax.set_title(title or f"{self.backend} trace: makespan {self.makespan * scale:.3g} {unit}")
        used = sorted({kinds.get(e.op, "other") for e in self.events}, key=OP_KINDS.index)
        handles = [Patch(color=colour[k], label=k) for k in used]
        if crit:
            handles.append(Patch(facecolor="white", edgecolor="black", label="critical path"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def events_from_sequence(ops: Sequence[str], durations: Sequence[float], device: str = "cpu",
                         threads: int = 1) -> Trace:
    """A trace of ops run back to back (handy for tests and the sequential baseline)."""
    t = 0.0
    out = []
    for op, d in zip(ops, durations):
        out.append(TraceEvent(op, t, t + d, device, threads))
        t += d
    return Trace(tuple(out), backend="sequence")
