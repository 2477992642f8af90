"""The validation split was once called "held-out": old config keys and old run folders still read."""

from __future__ import annotations

import json

import pytest

from opsched.agents.config import TrainConfig
from opsched.errors import ConfigError


def test_old_setting_names_are_read_as_the_new_ones(tmp_path):
    old = {"heldout_graphs": ["layered:20:5"], "heldout_machines": ["cpu:4:90:40"], "timesteps": 0}
    path = tmp_path / "config.yaml"
    import yaml

    path.write_text(yaml.safe_dump(old))
    cfg = TrainConfig.load(path)
    assert cfg.validation_graphs == ["layered:20:5"] and cfg.validation_machines == ["cpu:4:90:40"]
    assert "heldout" not in cfg.to_yaml() and "validation_graphs" in cfg.to_yaml()   # written with the new names
    assert TrainConfig(overrides={"heldout_graphs": "layered:20:6"}).resolve().validation_graphs == ["layered:20:6"]
    with pytest.raises(ConfigError, match="heldout_graphs.*validation_graphs"):
        TrainConfig.from_dict({"heldout_graphs": ["a"], "validation_graphs": ["b"]})


def test_an_old_run_folders_baselines_file_is_read(tmp_path):
    from opsched.agents.train import _read_baselines

    class OldRun:
        path = tmp_path

    rows = [{"graph": "layered:20:5", "machine": "cpu:4:90:40", "ops": 20, "cpf": 1.5}]
    (tmp_path / "heldout_baselines.json").write_text(json.dumps(rows))
    assert _read_baselines(OldRun()) == rows                   # type: ignore[arg-type]
    (tmp_path / "validation_baselines.json").write_text(json.dumps(rows[:0]))
    assert _read_baselines(OldRun()) == []                     # the new name wins when both are there
