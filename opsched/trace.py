"""Traces: what happened when a plan ran (simulated or measured), and their Gantt charts.

A chart has one row per *executor lane*, not per core: an op's lane is its
first core on a CPU (an op on 68 threads is one bar, not 68 identical ones)
and its stream on a GPU; ops that run one after another on the same slots
therefore share a row, so a sequential plan is one row rather than a wall of
stripes.  Backends that record no cores (TensorFlow) get lanes packed
greedily per device.  Each row is drawn with one ``broken_barh`` call, which
keeps a 500-op chart well under a second (the charts used to take most of
``opsched quickstart``'s time).
"""

from __future__ import annotations

import io
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

    def lane_rows(self) -> list[tuple[str, list[TraceEvent]]]:
        """The Gantt chart's rows, ``(label, events by start)``: one per executor
        lane -- a CPU op's first core (``cpu core 3``; its executor thread
        ``cpu executor 1`` where only that is known), a GPU op's stream
        (``gpu:0 stream 2``) -- and, for events with neither, lanes packed
        greedily per device (``cpu lane 0``).  The CPU first, then GPUs in order."""
        rows: dict[tuple[str, str, int], list[TraceEvent]] = {}
        unplaced: list[TraceEvent] = []
        for e in self.events:
            if e.device.startswith("gpu"):
                slot, what = (e.lane if e.lane is not None else (e.cores[0] if e.cores else None)), "stream"
            elif e.cores:
                slot, what = e.cores[0], "core"
            else:
                slot, what = e.lane, "executor"
            if slot is None:
                unplaced.append(e)
            else:
                rows.setdefault((e.device, what, int(slot)), []).append(e)
        ends: dict[str, list[float]] = {}
        for e in sorted(unplaced, key=lambda e: (e.start, e.end)):
            lane_ends = ends.setdefault(e.device, [])
            for i, end in enumerate(lane_ends):
                if end <= e.start + 1e-12:
                    lane_ends[i] = e.end
                    break
            else:
                i = len(lane_ends)
                lane_ends.append(e.end)
            rows.setdefault((e.device, "lane", i), []).append(e)
        order = sorted(rows, key=lambda k: (_device_order(k[0]), k[1], k[2]))
        return [(f"{d} {what} {slot}", sorted(rows[d, what, slot], key=lambda e: (e.start, e.end)))
                for d, what, slot in order]

    def lanes(self) -> list[list[TraceEvent]]:
        """The events of each Gantt row (see :meth:`lane_rows`)."""
        return [events for _, events in self.lane_rows()]

    def gantt(self, graph: OpGraph | None = None, title: str | None = None, max_rows: int = 80) -> Any:
        """The Gantt chart as a matplotlib ``Figure`` (see :meth:`plot`)."""
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        all_rows = self.lane_rows()
        rows = all_rows[:max_rows]
        kinds = {op.id: op.kind for op in graph.ops} if graph is not None else {}
        crit = set(self.critical_path(graph)) if graph is not None else set()
        palette = _kind_colours()
        scale, unit = (1.0, "s") if self.makespan >= 1.0 else (1e3, "ms")
        # Margins in inches, so the type stays the same size whatever the number of rows.
        label_chars = max((len(label) for label, _ in rows), default=8)
        used = {kinds.get(e.op, "other") for _, events in rows for e in events}
        legend_rows = len(used) + bool(crit) + bool(kinds)
        width, height = 12.0, max(3.0, 0.24 * len(rows) + 1.3, 0.2 * legend_rows + 1.4)
        left, right, bottom, top = 0.45 + 0.075 * label_chars, 1.9, 0.8, 0.45
        fig = Figure(figsize=(width, height))
        ax = fig.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (bottom + top) / height))
        for r, (_, events) in enumerate(rows):
            spans = [(e.start * scale, max(e.end - e.start, 0.0) * scale) for e in events]
            op_kinds = [kinds.get(e.op, "other") for e in events]
            on_crit = [e.op in crit for e in events]
            ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=[palette[k] for k in op_kinds],
                           edgecolors=["black" if c else "none" for c in on_crit],
                           linewidths=[1.2 if c else 0.0 for c in on_crit])
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(0.0, max(self.makespan * scale, 1e-12) * 1.01)
        ax.tick_params(axis="x", labelsize=9)
        ax.set_xlabel(f"time since the run started ({unit})", fontsize=10)
        more = f" (first {len(rows)} of {len(all_rows)})" if len(all_rows) > len(rows) else ""
        ax.set_ylabel(f"executor lane{more}", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(title or f"{self.backend} trace: makespan {self.makespan * scale:.4g} {unit}", fontsize=11)
        handles = [Patch(color=palette[k], label=k) for k in OP_KINDS if k in used]
        if crit:
            handles.append(Patch(facecolor="white", edgecolor="black", label="critical path"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9,
                  title="op kind" if kinds else None, title_fontsize=9, frameon=False)
        return fig

    def plot(self, path: str | Path, graph: OpGraph | None = None, title: str | None = None,
             max_rows: int = 80) -> Path:
        """Draw a Gantt chart to ``path`` (PNG): one row per executor lane (see
        :meth:`lane_rows`; at most ``max_rows``), bars coloured by op kind (with
        ``graph``), the critical path outlined in black, time in s or ms."""
        from opsched.io import atomic_write_bytes

        fig = self.gantt(graph, title, max_rows)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        out = Path(path)
        atomic_write_bytes(out, buf.getvalue())
        return out


def _device_order(device: str) -> tuple[int, int, str]:
    """The CPU first, then GPUs by number (gpu:2 before gpu:10)."""
    head, _, tail = device.partition(":")
    return (0 if head == "cpu" else 1, int(tail) if tail.isdigit() else -1, device)


def _kind_colours() -> dict[str, Any]:
    """One colour per op kind (tab20 without its pale halves for the common kinds)."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return {k: cmap((2 * i) % 20 + (i >= 10)) for i, k in enumerate(OP_KINDS)}


def events_from_sequence(ops: Sequence[str], durations: Sequence[float], device: str = "cpu",
                         threads: int = 1) -> Trace:
    """A trace of ops run back to back (handy for tests and the sequential baseline)."""
    t = 0.0
    out = []
    for op, d in zip(ops, durations):
        out.append(TraceEvent(op, t, t + d, device, threads))
        t += d
    return Trace(tuple(out), backend="sequence")
