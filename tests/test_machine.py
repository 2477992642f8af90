"""Machine: presets, probe, YAML, links, fingerprint."""

from __future__ import annotations

import pytest

from opsched.errors import MachineError
from opsched.machine import PRESETS, Machine, get_machine


def test_presets_are_valid_and_documented():
    assert set(PRESETS) == {"knl-68", "xeon-8180-2s", "dgx1-4v100", "2x2080ti", "4xa6000"}
    for m in PRESETS.values():
        assert m.source and m.description
        assert m.cpu.thread_levels()[0] == 1 and m.cpu.thread_levels()[-1] == m.cpu.cores
    assert PRESETS["knl-68"].cpu.cores == 68
    assert len(PRESETS["dgx1-4v100"].gpus) == 4
    assert PRESETS["xeon-8180-2s"].cpu.cores_per_socket == 28


def test_probe_reads_this_machine():
    import os

    m = Machine.probe()
    assert 1 <= m.cpu.cores <= len(os.sched_getaffinity(0))
    assert m.fingerprint() == Machine.probe().fingerprint()


def test_transfer_time_and_links():
    m = PRESETS["dgx1-4v100"]
    assert m.transfer_time(1e9, "gpu:0", "gpu:0") == 0.0
    t = m.transfer_time(25e9, "gpu:0", "gpu:1")
    assert t == pytest.approx(1.0 + 5e-6)
    # GPUs with no direct link go through the host
    rtx = PRESETS["2x2080ti"]
    assert rtx.link("gpu:0", "gpu:1") is not None


def test_yaml_round_trip(tmp_path):
    m = PRESETS["2x2080ti"]
    p = tmp_path / "mine.yaml"
    p.write_text(m.to_yaml())
    back = get_machine(str(p))
    assert back.fingerprint() == m.fingerprint()


def test_bad_machines(tmp_path):
    with pytest.raises(MachineError, match="unknown machine 'nope'"):
        get_machine("nope")
    p = tmp_path / "bad.yaml"
    p.write_text("devices:\n  - {id: gpu:0, kind: gpu, cores: 1, gflops: 1, mem_bandwidth_gbs: 1, memory_gb: 1}\n")
    with pytest.raises(MachineError, match="host device with id 'cpu'"):
        get_machine(str(p))
    p.write_text("devices: [1, 2")
    with pytest.raises(MachineError, match="not valid YAML"):
        get_machine(str(p))
