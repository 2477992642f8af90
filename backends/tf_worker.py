"""The TensorFlow worker process behind :class:`opsched.backends.tf_cpu.TFBackend`.

Why a process: TensorFlow creates its inter-op and intra-op thread pools once,
when the first session starts, and never resizes them.  So every
(inter, intra) setting lives in its own process, started as
``python -m opsched.backends.tf_worker --inter I --intra J --cpu-devices K``
and reused for every run with that setting.

Protocol (stdin/stdout of the worker, no pickle anywhere): a *message* is a
header frame - a UTF-8 JSON object - followed by ``header["nblobs"]`` raw byte
frames; a frame is an 8-byte little-endian length and that many bytes.  Blobs
carry a serialized ``GraphDef`` (protobuf) or ``.npy`` arrays
(``allow_pickle=False``).  The worker answers every request with one message
whose header has ``"ok": true`` or ``"ok": false, "error": ...``; it first
sends a ``hello`` with its pid, TensorFlow version and devices.

Requests:

* ``{"cmd": "load", "key", "feeds", "fetches", "arithmetic"}`` + GraphDef blob;
* ``{"cmd": "run", "key", "placement": {node: device id}, "after": {node:
  [nodes]}, "warmup", "repeats", "trace_runs", "return_outputs"}`` + one
  ``.npy`` blob per feed - answers ``wall_s`` (untraced runs), ``traces``
  (RunMetadata step stats of the traced runs: ``[node, op type, start_ns,
  end_ns, device]``), ``misplaced`` and, if asked, the outputs as blobs;
* ``{"cmd": "unload", "key"}``: drop a graph and its sessions;
* training steps (a ``load`` with a ``"step"`` entry, then ``run`` with a
  ``"state"``, ``state_set``, ``state_get``, ``state_drop``): see
  :mod:`opsched.backends.tf_step_worker` - the step's variables live in the
  worker and every run is one training step;
* ``{"cmd": "quit"}``.

The worker dies with its parent (``PR_SET_PDEATHSIG`` on Linux, and EOF on
stdin), so it can never outlive the backend that started it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from opsched.backends.tf_wire import (  # noqa: E402,F401 (the protocol; re-exported)
    MAX_FRAME,
    ChannelClosed,
    array_to_bytes,
    bytes_to_array,
    read_exact,
    read_message,
    write_message,
)
from opsched.lru import IdentityLRU


class _Worker:
    """Holds the loaded graphs and a small cache of sessions, one per placement."""

    MAX_SESSIONS = 8

    def __init__(self, inter: int, intra: int, cpu_devices: int) -> None:
        import tensorflow as tf

        self.tf = tf
        self.inter, self.intra, self.cpu_devices = inter, intra, cpu_devices
        # Fix the pools before TensorFlow initialises (the session config repeats them).
        tf.config.threading.set_inter_op_parallelism_threads(inter)
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        cpus = tf.config.list_physical_devices("CPU")
        if cpu_devices > 1 and cpus:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(cpu_devices)])
        self.gpus = len(tf.config.list_physical_devices("GPU"))
        self.graphs: dict[str, tuple[Any, list[str], list[str], bool]] = {}
        # (graph key, placement, after) -> (session, callable); an evicted session is closed
        self.sessions = IdentityLRU(self.MAX_SESSIONS, on_evict=lambda _key, entry: entry[0].close())
        from opsched.backends.tf_step_worker import StepGraphs

        self.steps = StepGraphs(self)  # training steps: variables and state (opsched.backends.tf_step_worker)

    def hello(self) -> dict[str, Any]:
        return {"ok": True, "pid": os.getpid(), "tf_version": self.tf.__version__, "inter": self.inter,
                "intra": self.intra, "cpu_devices": self.cpu_devices, "gpus": self.gpus}

    def device_name(self, dev: str) -> str:
        """Plan device id -> TF device: ``cpu`` is CPU:0; ``gpu:i`` is GPU:i when TF
        sees GPUs, else the logical CPU device i+1 that stands in for it."""
        if dev == "cpu":
            return "/device:CPU:0"
        kind, _, idx = dev.partition(":")
        if kind != "gpu" or not idx.isdigit():
            raise ValueError(f"unknown device id {dev!r}")
        i = int(idx)
        if i < self.gpus:
            return f"/device:GPU:{i}"
        if i + 1 < self.cpu_devices:
            return f"/device:CPU:{i + 1}"
        raise ValueError(f"device {dev!r}: TensorFlow sees {self.gpus} GPU(s) and this worker has "
                         f"{self.cpu_devices} logical CPU device(s)")

    def load(self, header: dict[str, Any], blobs: list[bytes]) -> dict[str, Any]:
        from tensorflow.core.framework import graph_pb2

        if header.get("step") is not None:  # a training step: its variables live in this worker
            return self.steps.load(header, blobs)
        gd = graph_pb2.GraphDef()  # pyright: ignore[reportAttributeAccessIssue] - generated protobuf, no stubs
        gd.ParseFromString(blobs[0])
        self.graphs[header["key"]] = (gd, list(header["feeds"]), list(header["fetches"]),
                                      bool(header.get("arithmetic", False)))
        return {"ok": True}

    def unload(self, key: str) -> dict[str, Any]:
        self.graphs.pop(key, None)
        self.steps.unload(key)
        for skey in [k for k in self.sessions.keys() if isinstance(k, tuple) and k[0] == key]:
            self.sessions.pop(skey)  # closes it
        return {"ok": True}

    def session_config(self, arithmetic: bool) -> Any:
        """The ConfigProto of every session of this worker: its pool sizes and devices."""
        tf = self.tf
        from tensorflow.core.protobuf import rewriter_config_pb2

        rewrite = rewriter_config_pb2.RewriterConfig()
        if not arithmetic:
            # Its rewrites move work across op boundaries (hoisting a Relu over a
            # Concat, Add(x, x) -> Mul): step stats would no longer belong to the op named.
            rewrite.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
        return tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=self.inter, intra_op_parallelism_threads=self.intra,
            device_count={"CPU": self.cpu_devices}, allow_soft_placement=True,
            graph_options=tf.compat.v1.GraphOptions(rewrite_options=rewrite),
        )

    def _session(self, key: str, placement: dict[str, str], after: dict[str, list[str]]) -> tuple[Any, Any]:
        skey = (key, tuple(sorted(placement.items())), tuple(sorted((k, tuple(v)) for k, v in after.items())))
        hit = self.sessions.get(skey)
        if hit is not None:
            return hit
        tf = self.tf
        from tensorflow.core.framework import graph_pb2

        base, feeds, fetches, arithmetic = self.graphs[key]
        gd = graph_pb2.GraphDef()  # pyright: ignore[reportAttributeAccessIssue] - generated protobuf, no stubs
        gd.CopyFrom(base)
        nodes = {n.name: n for n in gd.node}
        for name, dev in placement.items():
            if name in nodes:
                nodes[name].device = self.device_name(dev)
        for name, deps in after.items():
            for d in deps:
                if name in nodes and d in nodes:
                    nodes[name].input.append("^" + d)
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(gd, name="")
        sess = tf.compat.v1.Session(graph=graph, config=self.session_config(arithmetic))
        feed_t = [graph.get_tensor_by_name(n) for n in feeds]
        fetch_t = [graph.get_tensor_by_name(n) for n in fetches]
        fn = sess.make_callable(fetch_t, feed_list=feed_t, accept_options=True)
        self.sessions.put(skey, (sess, fn))
        return sess, fn

    def run(self, header: dict[str, Any], blobs: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        tf = self.tf
        key = header["key"]
        if key in self.steps:
            return self.steps.run(header, blobs)
        if key not in self.graphs:
            return {"ok": False, "error": f"graph {key!r} is not loaded in this worker"}, []
        placement = dict(header.get("placement", {}))
        _, fn = self._session(key, placement, dict(header.get("after", {})))
        feeds = [bytes_to_array(b) for b in blobs]
        outputs = None
        for _ in range(int(header.get("warmup", 1))):
            outputs = fn(*feeds)
        walls = []
        for _ in range(int(header.get("repeats", 0))):
            t = time.perf_counter_ns()
            outputs = fn(*feeds)
            walls.append((time.perf_counter_ns() - t) * 1e-9)
        traces = []
        misplaced: dict[str, str] = {}
        for _ in range(int(header.get("trace_runs", 0))):
            md = tf.compat.v1.RunMetadata()
            opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
            outputs = fn(*feeds, options=opts, run_metadata=md)
            events, wrong = self.step_events(md, placement)
            misplaced.update(wrong)
            traces.append(events)
        if outputs is None:  # nothing ran: run once so outputs can be returned
            outputs = fn(*feeds)
        out_blobs = [array_to_bytes(np.asarray(o)) for o in outputs] if header.get("return_outputs") else []
        return {"ok": True, "wall_s": walls, "traces": traces, "misplaced": misplaced}, out_blobs


    def step_events(self, md: Any, placement: dict[str, str], prefix: str = "") -> tuple[list[list[Any]], dict]:
        """A traced run's step stats as ``[node, op type, start_ns, end_ns, device]`` (node names with
        ``prefix`` removed; nodes outside it are kept as they are) and the nodes not where placed."""
        events, misplaced = [], {}
        for dev in md.step_stats.dev_stats:
            short = dev.device.rsplit("device:", 1)[-1]
            for ns in dev.node_stats:
                start = ns.all_start_nanos or ns.all_start_micros * 1000
                end = start + (ns.op_end_rel_nanos or ns.op_end_rel_micros * 1000)
                label = ns.timeline_label
                op_type = label.split(" = ", 1)[1].split("(", 1)[0] if " = " in label else ""
                node = ns.node_name.removeprefix(prefix) if prefix else ns.node_name
                events.append([node, op_type, int(start), int(end), short])
                want = placement.get(node)
                if want is not None and not self.device_name(want).endswith(short):
                    misplaced[node] = short
        return events, misplaced


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent and os.getppid() != parent:
        os._exit(3)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="opsched TensorFlow worker (speaks a framed protocol on stdio)")
    ap.add_argument("--inter", type=int, required=True)
    ap.add_argument("--intra", type=int, required=True)
    ap.add_argument("--cpu-devices", type=int, default=1)
    ap.add_argument("--parent", type=int, default=0)
    args = ap.parse_args(argv)
    _die_with_parent(args.parent)
    # The protocol owns the real stdout; anything printed (by TF or Python) goes to stderr.
    proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        worker = _Worker(args.inter, args.intra, max(1, args.cpu_devices))
    except Exception as exc:  # noqa: BLE001 - report any start-up failure to the parent
        write_message(proto_out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 2
    write_message(proto_out, worker.hello())
    while True:
        try:
            header, blobs = read_message(proto_in)
        except ChannelClosed:
            return 0
        cmd = header.get("cmd")
        if cmd == "quit":
            write_message(proto_out, {"ok": True})
            return 0
        try:
            if cmd == "load":
                reply, out = worker.load(header, blobs), []
            elif cmd == "unload":
                reply, out = worker.unload(str(header.get("key"))), []
            elif cmd == "run":
                reply, out = worker.run(header, blobs)
            elif cmd in ("state_set", "state_get", "state_drop"):
                reply, out = worker.steps.handle(cmd, header, blobs)
            else:
                reply, out = {"ok": False, "error": f"unknown command {cmd!r}"}, []
        except Exception as exc:  # noqa: BLE001 - the parent turns this into an ExecutionError
            reply, out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []
        write_message(proto_out, reply, out)


if __name__ == "__main__":
    sys.exit(main())
