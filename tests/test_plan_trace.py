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
