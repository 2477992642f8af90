"""Op profiles from ONNX Runtime's own profiler, in opsched's profile format.

:func:`profile_ort` runs the optimised graph of an imported ONNX model
(:func:`opsched.importers.onnx_graph.from_onnx`) whole, in one session per
thread level (``intra_op_num_threads`` 1, 2, 4 ... up to the machine's cores)
with ONNX Runtime's profiler on, and reads every node's kernel time of every
run from the profiler's trace (``<node>_kernel_time`` events, microseconds).
Levels are visited in interleaved rounds, so drift on a shared machine hits
them alike; the warm-up runs of each session are dropped.  The node times are
measured *in situ* - inside whole runs, with the caches as the neighbouring
nodes leave them - which is how the ``ort`` backend's segments run them.

Co-run interference: pairs of nodes (chosen by :func:`~opsched.backends.interference.choose_pairs`),
each as a one-node session at one thread, plus two synthetic ONNX kernels (a
GEMM, a streaming add far larger than the last-level cache), run side by side
on two threads (ONNX Runtime releases the interpreter lock in ``run``) and
alone; the slowdowns are fitted with :func:`~opsched.engine.models.interference.fit_interference`.

The result is a :class:`~opsched.engine.profiles.Profile`, saved like the
PyTorch profiles but in their own folder (:func:`ort_cache_dir`,
``runs/profiles/ort``): kernel times of ONNX Runtime must not stand in for
PyTorch's op times in the PyTorch planning model, nor the other way round.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from opsched.backends.profiler import _levels_for, _llc_bytes, load_cached, usable_cores
from opsched.cache import profiles_dir
from opsched.engine.profiles import OpProfile, Profile, ProfileError, cache_path
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.timing import ContentionMeter, wait_quiet

#: Sub-folder of a profile cache that holds ONNX Runtime's profiles.
ORT_SUBDIR = "ort"
#: A kernel the profiler reports as 0 µs took less than its resolution: this many seconds.
_FLOOR_S = 0.5e-6


def ort_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the ONNX Runtime profiles of a profile cache live."""
    return profiles_dir(cache_dir) / ORT_SUBDIR


def onnx_source(graph: OpGraph) -> Any:
    """The graph's :class:`~opsched.importers.onnx_graph.OnnxSource` (ProfileError without one)."""
    return graph.source_with(("submodel", "model"), ProfileError, "ONNX source to profile",
                             "opsched.importers.onnx_graph.from_onnx or opsched.specs.load_onnx_graph")


# ------------------------------------------------------------- kernel times
def _parse(path: str, warmup: int) -> tuple[dict[str, list[float]], list[float]]:
    """Per node its kernel seconds in each run after the first ``warmup``; and each run's seconds."""
    with open(path) as f:
        events = json.load(f)
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")[warmup:]
    if not runs:
        return {}, []
    starts = np.array([r[0] for r in runs])
    out: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        k = int(np.searchsorted(starts, e["ts"], side="right")) - 1
        if k < 0 or e["ts"] > runs[k][1]:
            continue
        out.setdefault(e["name"][: -len("_kernel_time")], []).append(max(float(e["dur"]) * 1e-6, _FLOOR_S))
    return out, [(b - a) * 1e-6 for a, b in runs]


def kernel_times(src: Any, threads: int, runs: int, warmup: int = 3, spinning: bool = True
                 ) -> tuple[dict[str, list[float]], list[float]]:
    """Run the whole optimised graph ``warmup + runs`` times at ``threads`` intra-op
    threads with ONNX Runtime's profiler on: per node its kernel seconds per run,
    and the runs' seconds."""
    import onnxruntime as ort

    from opsched.importers.onnx_graph import session_options

    with tempfile.TemporaryDirectory(prefix="opsched-ortprof-") as tmp:
        so = session_options(threads, "disable", spinning)
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "prof")
        sess = ort.InferenceSession(src.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feeds = dict(zip(src.inputs, src.example_inputs, strict=True))
        for _ in range(warmup + runs):
            sess.run(None, feeds)
        path = sess.end_profiling()
        return _parse(path, warmup)


# ------------------------------------------------------------- interference
def node_callable(src: Any, op_id: str, threads: int = 1, seed: int = 0) -> Callable[[], Any]:
    """One node as a one-node session on random inputs of its shapes, as a callable."""
    import onnxruntime as ort

    from opsched.importers.onnx_graph import random_arrays, session_options

    node = src.nodes[op_id]
    ins = [x for x in dict.fromkeys(node.input) if x and x not in src.initializers]
    outs = [x for x in node.output if x]
    sess = ort.InferenceSession(src.submodel([op_id], ins, outs, name=op_id), session_options(threads, "disable"),
                                providers=["CPUExecutionProvider"])
    feeds = {k: ort.OrtValue.ortvalue_from_numpy(a)
             for k, a in zip(ins, random_arrays([src.values[x] for x in ins], seed), strict=True)}
    return lambda: sess.run_with_ort_values(outs, feeds)


def synthetic_kernels(llc_bytes: float) -> dict[str, tuple[Callable[[], Any], float, float]]:
    """ONNX Runtime kernels that are surely compute- or memory-bound: (callable, flops, bytes)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from opsched.importers.onnx_graph import session_options

    def one(op: str, shape_a: list[int], shape_b: list[int], shape_y: list[int]) -> Callable[[], Any]:
        g = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"])], op,
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, shape_a),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, shape_b)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape_y)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        sess = ort.InferenceSession(m.SerializeToString(), session_options(1, "disable"),
                                    providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feeds = {"a": ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(shape_a).astype(np.float32)),
                 "b": ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(shape_b).astype(np.float32))}
        return lambda: sess.run_with_ort_values(["y"], feeds)

    n = 256
    m = int(max(4 * llc_bytes, 64e6) / 12)
    return {"gemm256": (one("MatMul", [n, n], [n, n], [n, n]), 2.0 * n**3, 3.0 * n * n * 4),
            "stream_add": (one("Add", [m], [m], [m]), 0.0, 12.0 * m)}


def measure_interference(graph: OpGraph, records: dict[str, OpProfile], level: int = 1,
                         on_pair: Callable[[], None] | None = None) -> dict[str, Any]:
    """Co-run pairs of the graph's nodes and of synthetic kernels; the fitted slowdown term."""
    from opsched.backends import interference as itf
    from opsched.engine.models import interference as itm

    src = onnx_source(graph)
    cands = {op.id: (records[op.id].median[level], op.flops, op.bytes_total) for op in graph.ops
             if 50e-6 <= records[op.id].median[level] <= 20e-3}
    pairs = itf.choose_pairs(cands, per_class=3)
    kernels = {op_id: (node_callable(src, op_id), cands[op_id][1], cands[op_id][2])
               for pair in pairs for op_id in pair}
    llc = _llc_bytes()
    kernels.update({f"synthetic:{k}": v for k, v in synthetic_kernels(llc).items()})
    pairs += [("synthetic:gemm256", "synthetic:gemm256"), ("synthetic:stream_add", "synthetic:stream_add"),
              ("synthetic:gemm256", "synthetic:stream_add")]
    bw_one = itf.measure_bandwidth(1, llc_bytes=llc)
    bw_all = itf.measure_bandwidth(min(usable_cores(), 2), llc_bytes=llc) if usable_cores() >= 2 else bw_one
    recs = itf.measure_pairs(kernels, pairs, threads=1, on_pair=on_pair) if usable_cores() >= 2 else []
    fit = itm.fit_interference(recs, bandwidth_gbs=max(bw_all, bw_one))
    return {"fit": fit.to_dict(), "threads_per_op": 1, "llc_bytes": llc,
            "bandwidth_gbs": {"one_stream": float(bw_one), "all_streams": float(bw_all)},
            "class_factors": itm.class_factors(recs), "pairs": [asdict(r) for r in recs]}


# ------------------------------------------------------------------ profile
def profile_ort(graph: OpGraph, machine: Machine | None = None, threads: Sequence[int] | None = None, *,
                runs: int = 20, warmup: int = 3, rounds: int = 3, refresh: bool = False,
                cache_dir: str | Path | None = None, interference: bool = True, max_attempts: int = 3,
                contention_limit: float = 0.25, quiet_wait_s: float = 60.0,
                progress: Callable[[str], None] | None = None) -> Profile:
    """Profile every node of an imported ONNX graph at each thread level with
    ONNX Runtime's profiler (see the module docstring); cached in ``cache_dir``
    (default ``runs/profiles/ort``) and reused unless ``refresh``.  A round
    measured while other processes used more than ``contention_limit`` cores
    is measured again once they leave (waiting up to ``quiet_wait_s``), up to
    ``max_attempts`` times; the quietest attempt is kept and the load recorded."""
    import onnxruntime as ort

    machine = machine or Machine.probe()
    levels = _levels_for(machine, threads)
    if runs < 1 or warmup < 0 or rounds < 1:
        raise ProfileError(f"runs and rounds must be >= 1 and warmup >= 0 (got {runs}, {rounds}, {warmup})")
    src = onnx_source(graph)
    folder = Path(cache_dir) if cache_dir is not None else ort_cache_dir()
    path = cache_path(graph, machine, folder)
    cached = None if refresh else load_cached(path, graph, levels, interference)
    if cached is not None:
        return cached
    say = progress or (lambda _msg: None)
    per_round = max(1, -(-runs // rounds))
    samples: dict[int, dict[str, list[float]]] = {k: {} for k in levels}
    run_s: dict[int, list[float]] = {k: [] for k in levels}
    others: list[float] = []
    for r in range(rounds):
        for k in (levels if r % 2 == 0 else tuple(reversed(levels))):
            say(f"{graph.name}: kernel times at {k} thread(s), round {r + 1}/{rounds}")
            best: tuple[float, Any] | None = None
            for attempt in range(max(1, max_attempts)):  # a round measured under load: again, once it is quiet
                if attempt:
                    wait_quiet(quiet_wait_s, contention_limit)
                with ContentionMeter() as meter:
                    got = kernel_times(src, k, per_round, warmup)
                if best is None or meter.others_cores < best[0]:
                    best = (meter.others_cores, got)
                if best[0] <= contention_limit:
                    break
            assert best is not None  # at least one attempt ran: max(1, max_attempts)
            others.append(best[0])
            times, walls = best[1]
            run_s[k] += walls
            for op_id, ts in times.items():
                samples[k].setdefault(op_id, []).extend(ts)
    missing = [op.id for op in graph.ops if any(op.id not in samples[k] for k in levels)]
    if missing:
        raise ProfileError(f"graph {graph.name!r}: ONNX Runtime's profiler reported no kernel time for "
                           f"{len(missing)} node(s), e.g. {missing[:3]} (graph and source do not match?)")
    load = float(np.median(others)) if others else 0.0
    records = {op.id: OpProfile(op.id, op.kind, float(op.flops), float(op.bytes_total), tuple(op.shape),
                                {k: tuple(samples[k][op.id]) for k in levels}, load)
               for op in graph.ops}
    inter = None
    if interference:
        say(f"{graph.name}: co-run pairs")
        inter = measure_interference(graph, records, levels[0])
    settings = {"runtime": "onnxruntime", "onnxruntime": ort.__version__, "source": "onnxruntime profiler",
                "opt_level": getattr(src, "opt_level", ""), "runs": runs, "warmup": warmup, "rounds": rounds,
                "run_s": {str(k): float(np.median(v)) for k, v in run_s.items() if v},
                "kernel_sum_s": {str(k): float(sum(p.median[k] for p in records.values())) for k in levels},
                "host": platform.node(), "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    prof = Profile(graph.fingerprint(), graph.name, machine.hardware_fingerprint(), machine.name, asdict(machine.cpu),
                   levels, records, inter, settings)
    prof.save(path)
    return prof


__all__ = ["ORT_SUBDIR", "kernel_times", "measure_interference", "node_callable", "onnx_source",
           "ort_cache_dir", "profile_ort", "synthetic_kernels"]
