"""AnalyticModel.time_table is vectorised; it must equal op_time op by op, to the last bit."""

from __future__ import annotations

import numpy as np
import pytest

from opsched.engine.models.analytic import AnalyticModel
from opsched.machine import get_machine
from opsched.synthetic import generate


@pytest.mark.parametrize("machine", ["xeon-8180-2s", "knl-68", "dgx1-4v100", "local"])
@pytest.mark.parametrize("family", ["layered", "erdos_renyi"])
def test_time_table_equals_op_time(machine: str, family: str) -> None:
    m = get_machine(machine)
    g = generate(family, 60, 7)
    model = AnalyticModel(launch_overhead_s=3e-6, sync_overhead_s=2e-6)
    table = model.time_table(g, m)
    for d, dev in enumerate(m.devices):
        for k, t in enumerate(table.levels[d]):
            expected = np.array([model.op_time(op, dev, t) for op in g.ops])
            np.testing.assert_array_equal(table.times[:, d, k], expected)
        assert np.all(np.isinf(table.times[:, d, len(table.levels[d]):]))


def test_subclass_op_time_is_used() -> None:
    class Doubled(AnalyticModel):
        def op_time(self, op, device, threads):  # type: ignore[override]
            return 2.0 * super().op_time(op, device, threads)

    m, g = get_machine("local"), generate("layered", 20, 1)
    np.testing.assert_array_equal(Doubled().time_table(g, m).times, 2.0 * AnalyticModel().time_table(g, m).times)
