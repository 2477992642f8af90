"""What crosses between cluster nodes (no Ray needed): array messages, infos with plans, cache paths,
the --cluster grammar; and training on profiled machines' planning models with local workers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from opsched.agents.cluster import ClusterError, parse_cluster
from opsched.agents.wire import (
    WireError,
    info_from_wire,
    info_to_wire,
    pack_arrays,
    parse_cache_file,
    safe_relpath,
    unpack_arrays,
)

DTYPES = st.sampled_from([np.float32, np.float64, np.int64, np.int32, np.bool_, np.uint8])


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text("abcdefg._", min_size=1, max_size=8),
                       DTYPES.flatmap(lambda d: hnp.arrays(d, hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))),
                       max_size=5),
       st.one_of(st.none(), st.integers(), st.lists(st.text(max_size=5), max_size=3)))
def test_array_messages_round_trip_exactly(arrays, meta):
    out, got_meta = unpack_arrays(pack_arrays(arrays, meta))
    assert got_meta == meta and list(out) == list(arrays)
    for k, a in arrays.items():
        assert out[k].dtype == a.dtype and out[k].shape == a.shape
        assert np.array_equal(out[k], a, equal_nan=a.dtype.kind == "f")
        assert out[k].flags.writeable


def test_array_messages_refuse_what_is_not_plain_numbers():
    with pytest.raises(WireError, match="only plain numbers"):
        pack_arrays({"x": np.array([object()], dtype=object)})
    blob = pack_arrays({"x": np.arange(4, dtype=np.int64)})
    with pytest.raises(WireError, match="runs past the end"):
        unpack_arrays(blob[:-1], "node 10.0.0.9")
    with pytest.raises(WireError, match="bytes left over"):
        unpack_arrays(blob + b"\0")
    with pytest.raises(WireError, match="bad magic"):
        unpack_arrays(b"\x80\x04pickle")
    forged = blob.replace(b'"<i8"', b'"|O8"')  # an object-dtype header: refused before any byte is read
    with pytest.raises(WireError, match="only plain numeric arrays"):
        unpack_arrays(forged)


def test_infos_keep_plain_data_and_plans_and_drop_the_rest(diamond):
    from opsched.machine import get_machine
    from opsched.plan import Plan
    from opsched.policies import get_policy

    plan = get_policy("critical-path-first").plan(diamond, get_machine("cpu:4:50:20"))
    wire = info_to_wire({"plan": plan, "makespan": np.float64(1.5), "n": 3, "trace": object(),
                         "episode": {"r": -1.0, "l": 4}})
    assert json.loads(json.dumps(wire)) == wire and "trace" not in wire
    back = info_from_wire(wire)
    assert isinstance(back["plan"], Plan) and back["plan"].to_dict() == plan.to_dict()
    assert back["makespan"] == 1.5 and back["episode"] == {"r": -1.0, "l": 4}


@pytest.mark.parametrize("path", ["/etc/passwd", "../x.json", "a/../../b.json", "runtime/x.pkl", "", "a\\b.json"])
def test_cache_paths_from_peers_stay_inside_the_cache(path):
    with pytest.raises(WireError):
        safe_relpath(path)


def test_cache_files_must_be_json():
    assert safe_relpath("runtime/abc/torch-cpu.json").parts == ("runtime", "abc", "torch-cpu.json")
    assert parse_cache_file("p.json", '{"a": 1}') == {"a": 1}
    with pytest.raises(WireError, match="not valid JSON"):
        parse_cache_file("p.json", "\x80\x04\x95")


def test_the_cluster_flag():
    assert str(parse_cluster("ray")) == "ray" and parse_cluster("ray").address is None
    assert parse_cluster("ray:10.0.0.5:6379").address == "10.0.0.5:6379"
    assert parse_cluster("ray:ray://head:10001").address == "ray://head:10001"
    for bad in ("dask", "ray:", "spark:x"):
        with pytest.raises(ClusterError):
            parse_cluster(bad)


@pytest.mark.slow
def test_training_on_profiled_machines_with_local_workers(tmp_path):
    """profiled_machines=all: the recorded machines become the training machines, priced by their own
    fitted models, in local subprocess workers."""
    pytest.importorskip("sb3_contrib")
    from typer.testing import CliRunner

    import opsched.commands.train  # noqa: F401
    from opsched.agents import Run
    from opsched.agents.profiled import record_machine
    from opsched.backends.profiler import profile_graph
    from opsched.cli import app
    from opsched.machine import Machine
    from opsched.specs import load_graph

    cache = tmp_path / "profiles"
    machine = Machine.probe()
    profile_graph(load_graph("zoo:lstm@1x0.5"), machine, threads=[1], warmup=1, repeats=3, cache_dir=cache,
                  interference=False, progress=False)
    record_machine(machine, cache)
    r = CliRunner().invoke(app, [
        "train-policy", "--out", str(tmp_path / "runs"), "--no-progress", "--hyperparams", "tiny", "--n-envs", "2",
        "--timesteps", "128", "--set", "max_nodes=32", "--set", "imitation_rounds=1",
        "--set", "train_graphs=layered:20:1,zoo:lstm@1x0.5", "--set", "validation_graphs=watts_strogatz:20:3",
        "--set", "validation_machines=cpu:16:80:100", "--set", "eval_freq=128", "--set", "checkpoint_freq=128",
        "--set", "profiled_machines=all", "--set", f"profiles_dir={cache}"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and not p.name.startswith(".")]
    cfg = Run.open(run).config
    assert cfg.train_machines == [str(cache / "machines" / f"{machine.fingerprint()}.yaml")]
    assert (run / "policy" / "policy.json").is_file() and not (run / "cluster.json").exists()
    # an unknown fingerprint is a one-line error naming the known ones
    r = CliRunner().invoke(app, ["train-policy", "--out", str(tmp_path / "runs2"), "--set",
                                 "profiled_machines=0123456789abcdef", "--set", f"profiles_dir={cache}"])
    assert r.exit_code != 0 and "not profiled" in str(r.exception) and machine.fingerprint() in str(r.exception)
