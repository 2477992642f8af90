"""Bad input gets a clear error (issue 17): machine YAML, graph JSON, policy files.

Every bad field is refused where it is read, by an ``OpschedError`` whose
message names the file, the device / link / op and the field; from the
command line that is one ``error:`` line and exit code 2, never a traceback.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsched.errors import GraphError, MachineError, PolicyError
from opsched.graph import Edge, Op, OpGraph
from opsched.machine import PRESETS, Device, Link, Machine, get_machine
from opsched.policies.exported import DIGEST_KEY, load, meta_digest, pretrained_path, write_policy
from opsched.policies.numpy_encoder import array_shapes


def run_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``opsched ARGS`` through :func:`opsched.cli.main`: (exit code, stdout, stderr)."""
    from opsched.cli import main

    monkeypatch.setattr(sys, "argv", ["opsched", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str) -> str:
    """The CLI's error as one string (rich may wrap a long line), checked to be no traceback."""
    assert "Traceback" not in err and err.lstrip().startswith("error:"), err
    return " ".join(err.split())


# ================================================================== machines
def _machine_yaml(tmp_path: Path, edit, preset: str = "dgx1-4v100") -> Path:
    data = PRESETS[preset].to_dict()
    edit(data)
    p = tmp_path / "mine.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def _set(field: str, value, k: int = 0):
    def edit(d):
        d["devices"][k][field] = value
    return edit


BAD_DEVICE_FIELDS = [
    ("cores", "sixty", "cores must be a whole number >= 1, got 'sixty' (str)"),
    ("cores", 8.5, "cores must be a whole number >= 1, got 8.5 (float)"),
    ("cores", True, "cores must be a whole number >= 1, got True (bool)"),
    ("cores", 0, "cores must be a whole number >= 1, got 0"),
    ("cores", None, "cores must be a whole number >= 1, got None"),
    ("gflops", "fast", "gflops must be a finite number > 0, got 'fast' (str)"),
    ("gflops", math.nan, "gflops must be a finite number > 0, got nan"),
    ("gflops", math.inf, "gflops must be a finite number > 0, got inf"),
    ("gflops", 0, "gflops must be a finite number > 0, got 0"),
    ("gflops", False, "gflops must be a finite number > 0, got False (bool)"),
    ("mem_bandwidth_gbs", -1.0, "mem_bandwidth_gbs must be a finite number > 0"),
    ("mem_bandwidth_gbs", math.inf, "mem_bandwidth_gbs must be a finite number > 0, got inf"),
    ("memory_gb", -16, "memory_gb must be a finite number >= 0, got -16"),
    ("memory_gb", [16], "memory_gb must be a finite number >= 0, got [16] (list)"),
    ("sockets", 0, "sockets must be a whole number >= 1, got 0"),
    ("sockets", 41, "sockets (41) cannot exceed cores (40)"),
    ("smt", -3, "smt must be a whole number >= 1, got -3"),
    ("smt", 2.0, "smt must be a whole number >= 1, got 2.0 (float)"),
    ("kind", "tpu", "kind must be 'cpu' or 'gpu', got 'tpu'"),
    ("name", 7, "name must be a string, got 7 (int)"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_DEVICE_FIELDS)
def test_every_device_field_is_checked(tmp_path, field, value, message):
    p = _machine_yaml(tmp_path, _set(field, value))
    with pytest.raises(MachineError) as err:
        get_machine(str(p))
    assert str(err.value).startswith(f"{p}: device 'cpu': "), str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize(("field", "value", "message"), BAD_DEVICE_FIELDS[:3] + BAD_DEVICE_FIELDS[5:8])
def test_a_bad_machine_file_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, field, value, message):
    p = _machine_yaml(tmp_path, _set(field, value), "knl-68")
    code, out, err = run_cli(["machine", str(p)], monkeypatch, capsys)
    assert code == 2 and not out
    text = one_line_error(err)
    assert str(p) in text and "device 'cpu'" in text and message in text


def test_gpu_devices_and_links_are_named(tmp_path):
    p = _machine_yaml(tmp_path, _set("cores", 2.5, k=2))
    with pytest.raises(MachineError, match=r"device 'gpu:1': cores must be a whole number"):
        get_machine(str(p))

    def edit(field, value, k=0):
        def f(d):
            d["links"][k][field] = value
        return f

    for field, value, message in [
        ("bandwidth_gbs", math.inf, "link cpu-gpu:0: bandwidth_gbs must be a finite number > 0, got inf"),
        ("bandwidth_gbs", "fast", "link cpu-gpu:0: bandwidth_gbs must be a finite number > 0, got 'fast' (str)"),
        ("bandwidth_gbs", 0, "link cpu-gpu:0: bandwidth_gbs must be a finite number > 0, got 0"),
        ("latency_us", -5, "link cpu-gpu:0: latency_us must be a finite number >= 0, got -5"),
        ("latency_us", math.nan, "link cpu-gpu:0: latency_us must be a finite number >= 0, got nan"),
        ("b", "cpu", "link cpu-cpu: a link joins two different devices"),
        ("b", "gpu:9", "link cpu-gpu:9 refers to unknown device 'gpu:9'"),
        ("b", 3, "each end must be a device id (a string), got 3 (int)"),
    ]:
        p = _machine_yaml(tmp_path, edit(field, value))
        with pytest.raises(MachineError) as err:
            get_machine(str(p))
        assert str(err.value).startswith(f"{p}: ") and message in str(err.value), (field, str(err.value))

    def twice(d):
        d["links"].append(dict(d["links"][0], a=d["links"][0]["b"], b=d["links"][0]["a"]))
    with pytest.raises(MachineError, match="two links between gpu:0 and cpu"):
        get_machine(str(_machine_yaml(tmp_path, twice)))


def test_malformed_machine_files(tmp_path):
    cases = [
        (lambda d: d.pop("devices"), "'devices' must be a non-empty list"),
        (lambda d: d.update(devices=[]), "'devices' must be a non-empty list"),
        (lambda d: d.update(devices={"cpu": 1}), "'devices' must be a non-empty list"),
        (lambda d: d.update(links="none"), "'links' must be a list"),
        (lambda d: d.update(device=[]), "unknown key 'device'; a machine has name, description"),
        (lambda d: d["devices"].__setitem__(1, 5), "devices[1] must be a mapping of fields, got 5 (int)"),
        (lambda d: d["devices"][0].pop("gflops"), "devices[0] ('cpu'): missing field 'gflops' (peak FP32 GFLOP/s"),
        (lambda d: d["devices"][0].update(gflop=1.0), "devices[0] ('cpu'): unknown field 'gflop'"),
        (lambda d: d["links"][0].pop("latency_us"), "links[0]: missing field 'latency_us'"),
        (lambda d: d.update(name=2080), "name must be a string, got 2080 (int)"),
        (lambda d: d["devices"][0].update(id="host"), "needs a host device with id 'cpu'"),
        (lambda d: d["devices"][0].update(id=""), "a device's id must be a non-empty string"),
        (lambda d: d["devices"][1].update(id="cpu"), "duplicate device ids"),
        (lambda d: d["devices"][0].update(kind="gpu"), "device 'cpu' (the host) must have kind 'cpu'"),
    ]
    for edit, message in cases:
        p = _machine_yaml(tmp_path, edit)
        with pytest.raises(MachineError) as err:
            get_machine(str(p))
        assert str(err.value).startswith(f"{p}: ") and message in str(err.value), (message, str(err.value))
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(MachineError, match="expected a mapping with 'devices'"):
        get_machine(str(p))
    p.write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(MachineError, match="cannot read the machine file"):
        get_machine(str(p))


def test_devices_and_links_made_in_code_are_checked_too():
    with pytest.raises(MachineError, match="device 'cpu': cores must be a whole number"):
        Device("cpu", "cpu", 8.5, 50.0, 20.0, 8.0)
    with pytest.raises(MachineError, match="link cpu-gpu:0: latency_us"):
        Link("cpu", "gpu:0", 12.0, -1.0)
    # numpy numbers are numbers; the stored values are plain Python ones (one fingerprint)
    d = Device("cpu", "cpu", np.int64(8), np.float32(50.0), 20, 8)
    assert type(d.cores) is int and type(d.gflops) is float and type(d.mem_bandwidth_gbs) is float
    assert d == Device("cpu", "cpu", 8, 50.0, 20.0, 8.0)


def test_cpu_specs_still_work_and_are_checked():
    # the figures (and so every cached profile's key) are unchanged by the checks
    assert get_machine("cpu:8:90:40").fingerprint() == "da30bee99d38a797"
    assert get_machine("cpu:40:90:180:2").fingerprint() == "cd578e11ba472b07"
    assert {n: m.fingerprint() for n, m in PRESETS.items()} == {
        "knl-68": "52be89045d7b17ef", "xeon-8180-2s": "b15f95bdf9135f05", "dgx1-4v100": "286d20111136a5d3",
        "2x2080ti": "742e24faab593ee3", "4xa6000": "01ec654f7251ed16"}
    m = get_machine("cpu:40:90:180:2")
    assert (m.cpu.cores, m.cpu.gflops, m.cpu.mem_bandwidth_gbs, m.cpu.sockets) == (40, 90.0, 180.0, 2)
    for spec, message in [
        ("cpu:8:90", "3 or 4 fields after 'cpu:', got 2"),
        ("cpu:x:90:40", "CORES must be a whole number, got 'x'"),
        ("cpu:8.5:90:40", "CORES must be a whole number, got '8.5'"),
        ("cpu:8:fast:40", "GFLOPS_PER_CORE must be a number, got 'fast'"),
        ("cpu:8:nan:40", "gflops must be a finite number > 0, got nan"),
        ("cpu:8:90:inf", "mem_bandwidth_gbs must be a finite number > 0, got inf"),
        ("cpu:0:90:40", "cores must be a whole number >= 1, got 0"),
        ("cpu:8:90:40:16", "sockets (16) cannot exceed cores (8)"),
    ]:
        with pytest.raises(MachineError) as err:
            get_machine(spec)
        assert str(err.value).startswith(f"machine spec {spec!r}: ") and message in str(err.value), str(err.value)


# ---------------------------------------------------------- the YAML template
def test_yaml_template_is_commented_and_loads_back_unchanged(tmp_path, monkeypatch, capsys):
    for name, m in PRESETS.items():
        text = m.to_yaml()
        p = tmp_path / f"{name}.yaml"
        p.write_text(text)
        back = get_machine(str(p))
        assert back.to_dict() == m.to_dict() and back.fingerprint() == m.fingerprint()
    text = PRESETS["dgx1-4v100"].to_yaml()
    # units, per core vs per device, what each field means
    for fragment in ("Units: GFLOP/s, GB/s, GB, microseconds", "gflops: 70.4", "of ONE core",
                     "gflops: 15700.0", "of the whole GPU", "physical cores", "concurrent streams",
                     "GB/s in each direction", "microseconds added to every transfer", "hardware threads per core"):
        assert fragment in text, fragment
    # the command prints the same template
    code, out, _ = run_cli(["machine", "knl-68", "--yaml"], monkeypatch, capsys)
    assert code == 0 and "# " in out
    p = tmp_path / "cli.yaml"
    p.write_text(out)
    assert get_machine(str(p)) == PRESETS["knl-68"]


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=30)


@st.composite
def machines(draw):
    cores = draw(st.integers(1, 512))
    cpu = Device("cpu", "cpu", cores, draw(st.floats(1e-3, 1e6)), draw(st.floats(1e-3, 1e5)),
                 draw(st.floats(0, 1e5)), sockets=draw(st.integers(1, cores)), smt=draw(st.integers(1, 8)),
                 name=draw(_names))
    n = draw(st.integers(0, 3))
    gpus = [Device(f"gpu:{i}", "gpu", draw(st.integers(1, 16)), draw(st.floats(1.0, 1e6)),
                   draw(st.floats(1.0, 1e5)), draw(st.floats(0, 512)), name=draw(_names)) for i in range(n)]
    links = [Link("cpu", f"gpu:{i}", draw(st.floats(1e-3, 1e4)), draw(st.floats(0, 1e4))) for i in range(n)]
    return Machine(draw(_names.filter(lambda s: s.strip())), (cpu, *gpus), tuple(links),
                   description=draw(_names), source=draw(_names))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(machines())
def test_any_valid_machine_round_trips_through_the_commented_yaml(tmp_path, m):
    p = tmp_path / "m.yaml"
    p.write_text(m.to_yaml(), encoding="utf-8")
    back = Machine.from_yaml(p)
    assert back.to_dict() == m.to_dict()


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["cores", "sockets", "smt"]),
       st.one_of(st.booleans(), st.floats(allow_nan=True), st.text(max_size=5), st.none(),
                 st.integers(max_value=0), st.lists(st.integers(1, 4), max_size=2)))
def test_counts_accept_only_whole_numbers(field, value):
    """A count is an int >= 1: not a bool, not a float (not even 4.0), not a string."""
    with pytest.raises(MachineError, match=f"device 'cpu': {field} must be a whole number >= 1"):
        Device("cpu", "cpu", **{"cores": 4, "gflops": 10.0, "mem_bandwidth_gbs": 10.0, "memory_gb": 1.0,
                                field: value})


# ==================================================================== graphs
def _graph_dict() -> dict:
    return {"format": "opsched.graph", "version": 1, "name": "g", "meta": {},
            "ops": [{"id": "a", "name": "a", "kind": "conv", "flops": 1.0, "shape": [1, 2]},
                    {"id": "b", "name": "b", "kind": "elementwise", "flops": 2.0}],
            "edges": [["a", "b", 4.0]]}


BAD_GRAPH_EDITS = [
    (lambda d: d["ops"][0].update(shape="abc"), "op 'a': shape must be a list of whole numbers >= 0, got 'abc' (str)"),
    (lambda d: d["ops"][0].update(shape=[1, -2]), "op 'a': shape must be a list of whole numbers >= 0"),
    (lambda d: d["ops"][0].update(shape=[1, 2.5]), "(the dimension 2.5 (float))"),
    (lambda d: d["ops"][0].update(shape=[True]), "(the dimension True (bool))"),
    (lambda d: d["ops"][0].update(shape=7), "op 'a': shape must be a list of whole numbers >= 0, got 7 (int)"),
    (lambda d: d["ops"][0].update(flops=True), "op 'a' has an invalid flops = True (bool)"),
    (lambda d: d["ops"][0].update(flops="3"), "op 'a' has an invalid flops = '3' (str)"),
    (lambda d: d["ops"][0].update(bytes_read=None), "op 'a' has an invalid bytes_read = None"),
    (lambda d: d["ops"][1].update(param_bytes=-1), "op 'b' has an invalid param_bytes = -1"),
    (lambda d: d["ops"][0].update(kind=3), "op 'a': kind must be a string, got 3 (int)"),
    (lambda d: d["ops"][0].update(kind="banana"), "op 'a' has unknown kind 'banana'"),
    (lambda d: d["ops"][0].update(dtype=None), "op 'a': dtype must be a string"),
    (lambda d: d["ops"][0].update(flop=1), "ops[0] ('a'): unknown field 'flop'; an op has id, name"),
    (lambda d: d["ops"][1].pop("name"), "ops[1] ('b'): missing field 'name'"),
    (lambda d: d["ops"][1].update(id=2), "ops[1]: id must be a non-empty string, got 2 (int)"),
    (lambda d: d["ops"].append("c"), "ops[2] must be a mapping of fields, got 'c' (str)"),
    (lambda d: d.update(ops={"a": {}}), "'ops' must be a list of ops"),
    (lambda d: d["edges"][0].__setitem__(2, True), "edges[0]: edge 'a' -> 'b' has an invalid bytes = True (bool)"),
    (lambda d: d["edges"][0].__setitem__(2, "4"), "edge 'a' -> 'b' has an invalid bytes = '4' (str)"),
    (lambda d: d["edges"][0].__setitem__(0, 1), "edges[0]: edge 1 -> 'b': both ends must be op ids"),
    (lambda d: d["edges"].__setitem__(0, ["a", "b"]), "edges[0] must be [src, dst, bytes], got ['a', 'b']"),
    (lambda d: d["edges"].append(["b", "zz", 1.0]), "refers to missing op 'zz'"),
    (lambda d: d.update(meta="x"), "meta must be a mapping, got 'x' (str)"),
    (lambda d: d.update(name=["g"]), "name must be a string, got ['g'] (list)"),
]


@pytest.mark.parametrize(("edit", "message"), BAD_GRAPH_EDITS)
def test_graph_json_fields_are_checked_strictly(tmp_path, edit, message):
    d = _graph_dict()
    edit(d)
    p = tmp_path / "g.json"
    p.write_text(json.dumps(d))
    with pytest.raises(GraphError) as err:
        OpGraph.load(p)
    assert str(err.value).startswith(f"{p}: ") and message in str(err.value), str(err.value)


def test_a_bad_graph_file_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    d = _graph_dict()
    d["ops"][0]["shape"] = "abc"
    p = tmp_path / "g.json"
    p.write_text(json.dumps(d))
    code, _, err = run_cli(["compare", "--model", str(p), "--machine", "knl-68", "--policies", "sequential",
                            "--out", str(tmp_path)], monkeypatch, capsys)
    assert code == 2
    assert f"{p}: op 'a': shape must be a list of whole numbers" in one_line_error(err)


def test_numpy_numbers_are_costs_and_are_stored_as_python_numbers():
    plain = OpGraph((Op("a", "a", "conv", 3.5, 4, 2.0, 0.0, (1, 2)), Op("b", "b")), (Edge("a", "b", 8.0),))
    numpy = OpGraph((Op("a", "a", "conv", np.float32(3.5), np.int64(4), np.float16(2.0), np.float64(0.0),
                        [np.int32(1), np.int64(2)]), Op("b", "b")), (Edge("a", "b", np.float32(8.0)),))
    assert numpy == plain and numpy.fingerprint() == plain.fingerprint()
    assert [type(getattr(numpy.ops[0], f)) for f in ("flops", "bytes_read", "bytes_written", "param_bytes")] == \
        [float, int, float, float]
    assert numpy.ops[0].shape == (1, 2) and all(type(x) is int for x in numpy.ops[0].shape)
    json.dumps(numpy.to_dict())  # serialisable
    with pytest.raises(GraphError, match=r"op 'a' has an invalid flops = np.True_"):
        Op("a", "a", flops=np.bool_(True))
    with pytest.raises(GraphError, match="op 'a' has an invalid flops = nan"):
        Op("a", "a", flops=np.float32("nan"))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["flops", "bytes_read", "bytes_written", "param_bytes"]),
       st.one_of(st.integers(0, 10**12), st.floats(0, 1e15), st.booleans(), st.text(max_size=4),
                 st.floats(max_value=-1e-9), st.just(math.inf), st.just(math.nan),
                 st.builds(np.float32, st.floats(0, 1e6, width=32)), st.builds(np.int64, st.integers(0, 10**9))))
def test_a_cost_is_a_finite_non_negative_number_never_a_bool(field, value):
    ok = (not isinstance(value, (bool, str)) and math.isfinite(float(value)) and float(value) >= 0)
    if ok:
        op = Op("x", "x", **{field: value})
        assert type(getattr(op, field)) in (int, float) and getattr(op, field) == value
    else:
        with pytest.raises(GraphError, match=f"op 'x' has an invalid {field}"):
            Op("x", "x", **{field: value})


# ================================================================== policies
@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {k: rng.normal(0.0, 0.3, s).astype(np.float32) for k, s in array_shapes(16, 1).items()}
    return write_policy(tmp_path_factory.mktemp("pol") / "policy", arrays, hidden=16, rounds=1, max_nodes=32,
                        machines=["knl-68"], source={"run": "test", "score": 0.5})


def _copy(folder: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in folder.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _leaves(obj, path=()):
    """Every (path, value) in a JSON tree, containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 1.0
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return 0
    if isinstance(value, list):
        return [*value, value[-1] if value else "x"]
    return {**value, "extra": 1}


def _put(meta, path, value):
    target = meta
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value


def test_policy_json_carries_a_digest_of_its_whole_content(policy_dir):
    meta = json.loads((policy_dir / "policy.json").read_text())
    assert meta[DIGEST_KEY] == meta_digest(meta) and len(meta[DIGEST_KEY]) == 64
    assert load(policy_dir).max_nodes == 32


def test_editing_any_entry_of_policy_json_is_refused(policy_dir, tmp_path):
    f = _copy(policy_dir, tmp_path / "p")
    original = json.loads((f / "policy.json").read_text())
    paths = [p for p, _ in _leaves(original) if p and p != (DIGEST_KEY,)]
    assert len(paths) > 100
    for path in paths:
        meta = copy.deepcopy(original)
        value = meta
        for k in path:
            value = value[k]
        _put(meta, path, _changed(value))
        (f / "policy.json").write_text(json.dumps(meta, indent=1))
        with pytest.raises(PolicyError, match=r"policy\.json: ") as err:
            load(f)
        if path[0] in ("observation", "machines", "source", "action") and path[-1] in (
                "max_nodes", "max_edges", "max_graph_ops", "gpus", "trained_on", "run", "n"):
            assert "changed after the policy was written" in str(err.value) or "out of range" in str(err.value), \
                (path, str(err.value))
    # removing an entry is an edit too
    meta = copy.deepcopy(original)
    del meta["source"]["score"]
    (f / "policy.json").write_text(json.dumps(meta))
    with pytest.raises(PolicyError, match=f"does not match its {DIGEST_KEY}"):
        load(f)


@pytest.mark.parametrize(("key", "value"), [("max_nodes", 64), ("max_edges", 100), ("max_edges", 129)])
def test_edited_sizes_are_refused_with_a_clear_message(policy_dir, tmp_path, key, value):
    f = _copy(policy_dir, tmp_path / "p")
    meta = json.loads((f / "policy.json").read_text())
    meta["observation"][key] = value
    if key == "max_nodes":  # consistently, as a careful hand would
        from opsched.engine.layout import ActionLayout

        meta["action"].update(n=ActionLayout(value).n, wait=ActionLayout(value).wait)
    (f / "policy.json").write_text(json.dumps(meta, indent=1))
    with pytest.raises(PolicyError, match=rf"policy\.json: the content does not match its {DIGEST_KEY}: an entry "
                                          "was changed after the policy was written"):
        load(f)
    # ... and without the digest (a file from before it) the sizes must still agree with each other
    del meta[DIGEST_KEY]
    (f / "policy.json").write_text(json.dumps(meta, indent=1))
    with pytest.raises(PolicyError, match=rf"has no {DIGEST_KEY} .* sizes disagree: .*export the policy again"):
        load(f)


def test_formatting_is_not_content(policy_dir, tmp_path):
    f = _copy(policy_dir, tmp_path / "p")
    meta = json.loads((f / "policy.json").read_text())
    reordered = dict(reversed(list(meta.items())))
    (f / "policy.json").write_text(json.dumps(reordered, indent=4, sort_keys=True))
    assert load(f).max_nodes == 32


def test_policies_from_before_the_digest_still_load(policy_dir, tmp_path):
    f = _copy(policy_dir, tmp_path / "p")
    meta = json.loads((f / "policy.json").read_text())
    del meta[DIGEST_KEY]
    (f / "policy.json").write_text(json.dumps(meta, indent=1))
    assert load(f).max_edges == 128
    # the shipped policy carries the digest of its content (re-exported with it, numbers unchanged)
    shipped = json.loads((pretrained_path() / "policy.json").read_text())
    assert shipped[DIGEST_KEY] == meta_digest(shipped)


def test_an_edited_policy_is_one_line_and_exit_2(policy_dir, tmp_path, monkeypatch, capsys):
    f = _copy(policy_dir, tmp_path / "p")
    meta = json.loads((f / "policy.json").read_text())
    meta["machines"]["max_graph_ops"] = 10_000
    (f / "policy.json").write_text(json.dumps(meta, indent=1))
    code, _, err = run_cli(["compare", "--model", "layered:10:1", "--machine", "knl-68", "--policies", str(f),
                            "--out", str(tmp_path)], monkeypatch, capsys)
    assert code == 2
    assert f"{f / 'policy.json'}: the content does not match its {DIGEST_KEY}" in one_line_error(err)
