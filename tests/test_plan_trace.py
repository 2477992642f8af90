"""Plan validation and JSON; Trace makespan, critical path and Gantt plot."""

from __future__ import annotations

import pytest

from opsched.errors import PlanError
from opsched.machine import PRESETS
from opsched.plan import Assignment, Plan, uniform_plan
from opsched.trace import Trace, TraceEvent


def test_plan_validation(diamond):
    m = PRESETS["dgx1-4v100"]
    good = uniform_plan(diamond, m, threads=4)
    good.validate(diamond, m)
    a = dict(good.assignments)
    with pytest.raises(PlanError, match="no assignment for 1 op"):
        Plan.build(diamond, m, {k: v for k, v in a.items() if k != "d"})
    with pytest.raises(PlanError, match="'gpu:9'"):
        Plan.build(diamond, m, {**a, "b": Assignment("gpu:9", 1, 0.0)})
    with pytest.raises(PlanError, match="asks for 41 threads"):
        Plan.build(diamond, m, {**a, "b": Assignment("cpu", 41, 0.0)})
    with pytest.raises(PlanError, match="threads=1"):
        Plan.build(diamond, m, {**a, "b": Assignment("gpu:0", 2, 0.0)})
    with pytest.raises(PlanError, match="deadlock"):
        Plan.build(diamond, m, {**a, "a": Assignment("cpu", 1, 0.0, after=("d",))})
    with pytest.raises(PlanError, match="different machine"):
        good.validate(diamond, PRESETS["knl-68"])


def test_plan_json_round_trip(tmp_path, diamond):
    m = PRESETS["knl-68"]
    p = uniform_plan(diamond, m, threads=8, policy="test")
    path = tmp_path / "plan.json"
    p.save(path)
    assert Plan.load(path) == p
    path.write_text(path.read_text()[:40])
    with pytest.raises(PlanError, match="perhaps truncated"):
        Plan.load(path)


def test_trace_and_gantt(tmp_path, diamond):
    events = (
        TraceEvent("a", 0.0, 1.0, "cpu", 2, (0, 1)),
        TraceEvent("b", 1.0, 3.0, "cpu", 1, (0,)),
        TraceEvent("c", 1.0, 4.0, "cpu", 1, (1,)),
        TraceEvent("d", 4.0, 5.0, "cpu", 2, (0, 1)),
    )
    tr = Trace(events, backend="test")
    assert tr.makespan == 5.0
    assert tr.critical_path(diamond) == ["a", "c", "d"]
    out = tr.plot(tmp_path / "gantt.png", diamond)
    assert out.exists() and out.stat().st_size > 1000
    back = Trace.from_dict(tr.to_dict())
    assert back.events == tr.events


# ------------------------------------------------------------------ Gantt charts
def _sim_trace(n_ops: int, machine: str, policy: str):
    from opsched.backends.sim import SimBackend
    from opsched.policies import get_policy
    from opsched.synthetic import generate

    g = generate("layered", n_ops, 1)
    m = PRESETS[machine]
    return g, SimBackend(m).run(g, get_policy(policy).plan(g, m))


@pytest.mark.parametrize(("machine", "policy"), [("knl-68", "cpf"), ("dgx1-4v100", "heft")])
def test_a_500_op_chart_has_one_row_per_lane(tmp_path, machine, policy):
    g, tr = _sim_trace(500, machine, policy)
    expected = {(e.device, e.lane if e.device.startswith("gpu") else e.cores[0]) for e in tr.events}
    assert len(tr.lanes()) == len(expected)
    assert sorted(len(row) for row in tr.lanes()) and sum(len(row) for row in tr.lanes()) == 500  # each op once
    out = tr.plot(tmp_path / "g.png", g, title="500 ops")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = tr.gantt(g)
    (ax,) = fig.axes
    assert len(ax.get_yticks()) == len(expected)
    assert len(ax.collections) == len(expected)  # one broken_barh per row, not one artist per op and core
    assert all(t.get_fontsize() >= 8 for t in ax.get_yticklabels() + ax.get_xticklabels())
    assert ax.get_xlabel() == "time since the run started (ms)" and ax.get_ylabel() == "executor lane"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "critical path" in legend and set(legend) - {"critical path"} == {op.kind for op in g.ops}


def test_a_many_threaded_sequence_is_one_row_and_lanes_are_labelled():
    seq = Trace(tuple(TraceEvent(f"o{i}", i, i + 1.0, "cpu", 68, tuple(range(68)), None) for i in range(30)))
    assert [label for label, _ in seq.lane_rows()] == ["cpu core 0"]
    mixed = Trace((
        TraceEvent("a", 0.0, 1.0, "cpu", 4, (4, 5, 6, 7)),
        TraceEvent("b", 0.0, 2.0, "cpu", 4, (0, 1, 2, 3)),
        TraceEvent("c", 0.0, 1.0, "gpu:10", 1, (1,), 1),
        TraceEvent("d", 0.0, 1.0, "gpu:2", 1, (0,), 0),
        TraceEvent("e", 1.0, 2.0, "cpu", 2, (4, 5)),
    ))
    assert [label for label, _ in mixed.lane_rows()] == ["cpu core 0", "cpu core 4", "gpu:2 stream 0",
                                                         "gpu:10 stream 1"]
    assert [e.op for e in mixed.lane_rows()[1][1]] == ["a", "e"]
    # no cores recorded (TensorFlow): lanes packed per device, overlapping ops on different rows
    tf = Trace(tuple(TraceEvent(o, s, e, "cpu", 1) for o, s, e in
                     [("a", 0, 2), ("b", 0, 1), ("c", 1, 3), ("d", 2, 4)]))
    assert [(label, [e.op for e in evs]) for label, evs in tf.lane_rows()] == [
        ("cpu lane 0", ["b", "c"]), ("cpu lane 1", ["a", "d"])]
    # over a second: the axis is in seconds
    assert seq.gantt().axes[0].get_xlabel() == "time since the run started (s)"


def test_rows_beyond_max_rows_are_counted_in_the_axis_title(tmp_path):
    tr = Trace(tuple(TraceEvent(f"o{i}", 0.0, 1e-3, "cpu", 1, (i,)) for i in range(12)))
    fig = tr.gantt(max_rows=5)
    assert len(fig.axes[0].get_yticks()) == 5 and fig.axes[0].get_ylabel() == "executor lane (first 5 of 12)"
