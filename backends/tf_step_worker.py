"""Training steps inside a TensorFlow worker process (:mod:`opsched.backends.tf_worker`).

A step graph (:class:`opsched.importers.tf_step.TFStepSource`) reads and
writes variables, so unlike an inference graph it carries state from one run
to the next.  Per step graph the worker holds:

* **one session** whose graph has one ``VarHandleOp`` per step variable (on
  ``/device:CPU:0``) with an assign and a read op each;
* **one copy of the step per plan**: the step's GraphDef with the plan's
  devices and control dependencies, imported under its own name prefix with
  every resource placeholder mapped to the session's variable
  (``import_graph_def(input_map=...)``), so all copies train the same
  variables and each is optimised by Grappler once;
* **named states**: the variables hold the *active* state's values; another
  state's are kept as arrays and swapped in when a request names it (the
  state ``scratch``, where timing runs, starts from the capture's values and
  is reset to them every :data:`SCRATCH_RESET` steps so that timing never
  trains the user's model and never drifts into NaNs).

Requests (framed as the rest of the protocol; blobs are ``.npy``):

* ``load`` with a ``step`` header entry ``{"variables": [[node, dtype, shape], ...]}``
  and blobs GraphDef + one initial value per variable;
* ``run`` with ``"state"`` and ``"copy"`` (the client's digest of the plan's
  placement and control dependencies; ``placement`` and ``after`` come with it
  the first time only): ``warmup + repeats + trace_runs`` training steps on
  that state (each one updates it), answering as for an inference graph plus
  ``losses`` (every step's loss) and, with ``return_outputs``, the last loss;
* ``state_set`` ``{"key", "state", "which": [i, ...] | null, "layout"}`` + one
  raw blob (:func:`pack`: the arrays' bytes end to end, ``layout`` their dtypes
  and shapes): the state's values (``which`` null: all, in order);
* ``state_get`` ``{"key", "state", "which"}``: answers the same way;
* ``state_drop`` ``{"key", "state"}``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import numpy as np

#: Steps after which the scratch state is reset to the capture's values.
SCRATCH_RESET = 32
#: Plan copies one session keeps; beyond it the session is rebuilt (the state survives).
MAX_COPIES = 8
SCRATCH = "scratch"


def pack(arrays: list[np.ndarray]) -> tuple[list[list[Any]], bytes]:
    """Arrays as one raw blob and its layout ``[[dtype, shape], ...]`` (a state is hundreds of
    arrays: one frame, no per-array ``.npy`` header to write and parse)."""
    arrays = [np.ascontiguousarray(a).reshape(np.shape(a)) for a in arrays]
    return [[a.dtype.str, list(a.shape)] for a in arrays], b"".join(a.tobytes() for a in arrays)


def unpack(layout: list[list[Any]], blob: bytes) -> list[np.ndarray]:
    """The arrays :func:`pack` packed (read-only views of ``blob``)."""
    out, offset = [], 0
    for dtype, shape in layout:
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError(f"dtype {dtype!r} is not a plain numeric type")
        n = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(blob, dt, count=n, offset=offset).reshape(shape))
        offset += n * dt.itemsize
    if offset != len(blob):
        raise ValueError(f"state blob of {len(blob)} bytes for a layout of {offset}")
    return out


class _Step:
    """One step graph in one worker: its session, variables, plan copies and states."""

    def __init__(self, worker: Any, header: dict[str, Any], blobs: list[bytes]) -> None:
        from opsched.backends.tf_wire import bytes_to_array

        tf = worker.tf
        from tensorflow.core.framework import graph_pb2

        self.worker = worker
        self.base = graph_pb2.GraphDef()  # pyright: ignore[reportAttributeAccessIssue] - generated protobuf, no stubs
        self.base.ParseFromString(blobs[0])
        self.feeds = list(header["feeds"])
        self.fetches = list(header["fetches"])
        self.arithmetic = bool(header.get("arithmetic", False))
        self.vars = [(str(n), str(d), tuple(int(s) for s in shape)) for n, d, shape in header["step"]["variables"]]
        if len(blobs) != 1 + len(self.vars):
            raise ValueError(f"step graph {header['key']!r}: {len(self.vars)} variables but "
                             f"{len(blobs) - 1} initial values")
        self.initial = [bytes_to_array(b) for b in blobs[1:]]
        self.tf = tf
        self.active: str | None = None
        self.saved: dict[str, list[np.ndarray]] = {}
        self.since_reset = 0
        self.specs: dict[str, tuple[dict[str, str], dict[str, list[str]]]] = {}  # digest -> placement, after
        self._build()

    # ---------------------------------------------------------- session
    def _build(self) -> None:
        tf = self.tf
        self.graph = tf.Graph()
        self.handles, self.setters, self.assigns, self.reads = [], [], [], []
        with self.graph.as_default(), tf.device("/device:CPU:0"):
            for i, (_node, dtype, shape) in enumerate(self.vars):
                h = tf.raw_ops.VarHandleOp(dtype=tf.as_dtype(dtype), shape=shape, shared_name=f"opsched_v{i}",
                                           name=f"opsched_vars/v{i}")
                ph = tf.compat.v1.placeholder(tf.as_dtype(dtype), shape, name=f"opsched_vars/set{i}")
                self.handles.append(h)
                self.setters.append(ph)
                self.assigns.append(tf.raw_ops.AssignVariableOp(resource=h, value=ph, name=f"opsched_vars/assign{i}"))
                self.reads.append(tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.as_dtype(dtype),
                                                            name=f"opsched_vars/read{i}"))
        self.session = tf.compat.v1.Session(graph=self.graph, config=self.worker.session_config(self.arithmetic))
        self.copies: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        self.counter = 0

    def close(self) -> None:
        self.session.close()

    def _rebuild(self) -> None:
        """A fresh session without the plan copies; the active state's values survive."""
        values = self._read() if self.active is not None else None
        self.session.close()
        self._build()
        if values is not None:
            self._assign(values)

    def _copy(self, digest: str, placement: dict[str, str] | None,
              after: dict[str, list[str]] | None) -> tuple[str, Any]:
        """The step's copy for one plan, named by the client's ``digest`` of its placement and
        control dependencies (sent once; imported on first use, again after a rebuild)."""
        hit = self.copies.get(digest)
        if hit is not None:
            self.copies.move_to_end(digest)
            return hit
        if placement is None or after is None:
            placement, after = self.specs.get(digest, (None, None))
            if placement is None or after is None:
                raise KeyError(f"plan copy {digest!r} is unknown to this worker; send its placement and after")
        self.specs[digest] = (placement, after)
        if len(self.copies) >= MAX_COPIES:
            self._rebuild()
        tf = self.tf
        from tensorflow.core.framework import graph_pb2

        gd = graph_pb2.GraphDef()  # pyright: ignore[reportAttributeAccessIssue] - generated protobuf, no stubs
        gd.CopyFrom(self.base)
        nodes = {n.name: n for n in gd.node}
        for name, dev in placement.items():
            if name in nodes:
                nodes[name].device = self.worker.device_name(dev)
        for name, deps in after.items():
            for d in deps:
                if name in nodes and d in nodes:
                    nodes[name].input.append("^" + d)
        prefix = f"opsched_p{self.counter}"
        self.counter += 1
        input_map = {f"{node}:0": self.handles[i] for i, (node, _, _) in enumerate(self.vars)}
        with self.graph.as_default():
            tf.graph_util.import_graph_def(gd, input_map=input_map, name=prefix)
        feed_t = [self.graph.get_tensor_by_name(f"{prefix}/{n}") for n in self.feeds]
        fetch_t = [self.graph.get_tensor_by_name(f"{prefix}/{n}") for n in self.fetches]
        fn = self.session.make_callable(fetch_t, feed_list=feed_t, accept_options=True)
        self.copies[digest] = (prefix, fn)
        return prefix, fn

    # ------------------------------------------------------------ state
    def _read(self, which: list[int] | None = None) -> list[np.ndarray]:
        idx = range(len(self.vars)) if which is None else which
        return list(self.session.run([self.reads[i] for i in idx]))

    def _assign(self, values: list[np.ndarray], which: list[int] | None = None) -> None:
        idx = list(range(len(self.vars))) if which is None else which
        if len(values) != len(idx):
            raise ValueError(f"{len(values)} values for {len(idx)} variables")
        for i, v in zip(idx, values):
            want = (self.vars[i][1], self.vars[i][2])
            if (str(v.dtype), tuple(v.shape)) != want:
                raise ValueError(f"variable {self.vars[i][0]!r} is {want[0]}{list(want[1])}, got "
                                 f"{v.dtype}{list(v.shape)}")
        self.session.run([self.assigns[i] for i in idx], {self.setters[i]: v for i, v in zip(idx, values)})

    def activate(self, state: str, load: bool = True) -> None:
        """Make ``state`` the variables' values (the active one's saved first)."""
        if self.active == state:
            return
        if self.active is not None:
            self.saved[self.active] = self._read()
        values = self.saved.pop(state, None)
        if load:
            self._assign(values if values is not None else self.initial)
        self.active = state
        self.since_reset = 0

    def state_set(self, state: str, values: list[np.ndarray], which: list[int] | None) -> None:
        self.activate(state, load=which is not None)
        self._assign(values, which)
        self.since_reset = 0

    def state_get(self, state: str, which: list[int] | None) -> list[np.ndarray]:
        if self.active == state:
            return self._read(which)
        values = self.saved.get(state, self.initial)
        return [values[i] for i in (range(len(values)) if which is None else which)]

    def state_drop(self, state: str) -> None:
        self.saved.pop(state, None)
        if self.active == state:
            self.active = None

    # -------------------------------------------------------------- run
    def run(self, header: dict[str, Any], feeds: list[np.ndarray]) -> tuple[dict[str, Any], list[bytes]]:
        from opsched.backends.tf_wire import array_to_bytes

        tf = self.tf
        state = str(header.get("state", SCRATCH))
        self.activate(state)
        digest = str(header["copy"])
        given = header.get("placement")
        prefix, fn = self._copy(digest, None if given is None else dict(given),
                                None if given is None else dict(header.get("after", {})))
        placement = self.specs[digest][0]
        losses: list[float] = []
        outputs = None

        def once(**kw: Any) -> Any:
            if state == SCRATCH and self.since_reset >= SCRATCH_RESET:
                self._assign(self.initial)
                self.since_reset = 0
            out = fn(*feeds, **kw)
            self.since_reset += 1
            losses.append(float(np.asarray(out[0])))
            return out

        for _ in range(int(header.get("warmup", 0))):
            outputs = once()
        walls = []
        for _ in range(int(header.get("repeats", 0))):
            t = time.perf_counter_ns()
            outputs = once()
            walls.append((time.perf_counter_ns() - t) * 1e-9)
        traces, misplaced = [], {}
        for _ in range(int(header.get("trace_runs", 0))):
            md = tf.compat.v1.RunMetadata()
            opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
            outputs = once(options=opts, run_metadata=md)
            events, wrong = self.worker.step_events(md, placement, prefix=prefix + "/")
            traces.append(events)
            misplaced.update(wrong)
        if outputs is None:
            outputs = once()
        out_blobs = [array_to_bytes(np.asarray(o)) for o in outputs] if header.get("return_outputs") else []
        return {"ok": True, "wall_s": walls, "traces": traces, "misplaced": misplaced, "losses": losses,
                "state": state}, out_blobs


class StepGraphs:
    """The step graphs a worker has loaded (by key)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.steps: dict[str, _Step] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.steps

    def load(self, header: dict[str, Any], blobs: list[bytes]) -> dict[str, Any]:
        old = self.steps.pop(header["key"], None)
        if old is not None:
            old.close()
        self.steps[header["key"]] = _Step(self.worker, header, blobs)
        return {"ok": True}

    def unload(self, key: str) -> None:
        step = self.steps.pop(key, None)
        if step is not None:
            step.close()

    def _get(self, header: dict[str, Any]) -> _Step:
        key = header.get("key")
        if key not in self.steps:
            raise KeyError(f"step graph {key!r} is not loaded in this worker")
        return self.steps[key]

    def run(self, header: dict[str, Any], blobs: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        from opsched.backends.tf_wire import bytes_to_array

        return self._get(header).run(header, [bytes_to_array(b) for b in blobs])

    def handle(self, cmd: str, header: dict[str, Any], blobs: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """``state_set`` / ``state_get`` / ``state_drop`` (values as one :func:`pack` blob)."""
        step = self._get(header)
        state = str(header.get("state", SCRATCH))
        which = header.get("which")
        which = None if which is None else [int(i) for i in which]
        if cmd == "state_set":
            step.state_set(state, unpack(header["layout"], blobs[0]), which)
            return {"ok": True}, []
        if cmd == "state_get":
            layout, blob = pack(step.state_get(state, which))
            return {"ok": True, "layout": layout}, [blob]
        if cmd == "state_drop":
            step.state_drop(state)
            return {"ok": True}, []
        return {"ok": False, "error": f"unknown command {cmd!r}"}, []


__all__ = ["MAX_COPIES", "SCRATCH", "SCRATCH_RESET", "StepGraphs", "pack", "unpack"]
