"""The environment's observation and action layout, in one place.

Both the environment (``opsched.envs.schedule_env``) and the learned policy
(``opsched.agents`` and the exported numpy scheduler in
``opsched.policies``) read these constants and helpers, so the meaning of
every observation column and action index is written down exactly once.

Action encoding (a flat ``Discrete`` whose mask is joint, because
MaskablePPO masks MultiDiscrete dimensions independently):

    index = (slot * MAX_DEVICES + device) * MAX_LEVELS + level,   for a start
    index = max_nodes * MAX_DEVICES * MAX_LEVELS,                 for "wait"

``slot`` is the op's position in the (possibly coarsened) graph, ``device``
the index into ``machine.devices``, ``level`` the index into that device's
``thread_levels()``.  The environment's ``action_masks()`` returns a boolean
vector of length ``ActionLayout(max_nodes).n`` in this order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The most devices a machine may have for the env (host CPU + 7 GPUs).
MAX_DEVICES = 8
#: The most thread levels per device (1, 2, 4, ..., 64, all cores) = 8.
MAX_LEVELS = 8
#: Flat actions per op slot (devices x levels).
PER_SLOT = MAX_DEVICES * MAX_LEVELS

#: The observation's keys (a gymnasium ``Dict`` of ``Box``es), with shapes for
#: ``N = max_nodes`` and ``E = max_edges``:
#: node_static (N, len(STATIC_FEATURES)) float32, node_dynamic (N, len(DYNAMIC_FEATURES))
#: float32, node_mask (N,) float32, edge_index (2, E) int64 (row 0 source slot, row 1
#: target slot; padding 0), edge_mask (E,) float32, hardware (MAX_DEVICES,
#: len(HARDWARE_FEATURES)) float32, globals (len(GLOBAL_FEATURES),) float32, and
#: node_levels: the per-op time curve over the CPU's thread levels (N, MAX_LEVELS)
#: float32 in [-1, 1]: ``log2(t(1) / t(k_l)) / 7`` per op and CPU thread level
#: ``k_l`` (0 for padding and absent levels); see
#: :func:`opsched.engine.observe.level_features`.  Why: the best thread count
#: is where an op's time curve bottoms out, and ``node_static`` gives only two
#: points of it (1 thread and all cores).  An exported policy records whether
#: it reads it.
LEVEL_KEY = "node_levels"
OBS_KEYS: tuple[str, ...] = (
    "node_static", "node_dynamic", "node_mask", "edge_index", "edge_mask", "hardware", "globals", LEVEL_KEY,
)
#: Default padding: edges per node slot when ``max_edges`` is not given.
EDGES_PER_NODE = 4

#: "reference" below is the graph's sequential makespan (every op alone, one
#: after another, with all CPU cores) in the simulator -- the reward reference
#: of simulated episodes; observations use it in real mode too.  All columns
#: lie in [0, 1] (values are clipped where noted) but node_levels' [-1, 1].
#: Per-op static features (columns of obs["node_static"]).
STATIC_FEATURES: tuple[str, ...] = (
    # one-hot kind, 11 columns, in opsched.graph.OP_KINDS order
    "kind_conv", "kind_matmul", "kind_elementwise", "kind_pool", "kind_norm", "kind_concat_split",
    "kind_reduce", "kind_embedding", "kind_rnn", "kind_attention", "kind_other",
    "log_flops",          # log10(1 + flops) / 12, clipped to 1
    "log_bytes",          # log10(1 + bytes read + written) / 10, clipped to 1
    "time_1",             # predicted CPU time at 1 thread / sum of every op's CPU time at 1 thread
    "scaling",            # parallel efficiency on all CPU cores: time_1 / (cores * time_all), clipped to 1
                          # (1 = perfect speed-up, ~1/cores = none)
    "best_time",          # fastest predicted time over devices and levels / reference
    "upward_rank",        # upward rank (fastest times) / critical path length
    "in_degree",          # in-degree / 8 (clipped to 1)
    "out_degree",         # out-degree / 8 (clipped to 1)
    "gpu_time",           # predicted time on the first GPU / reference (clipped to 1); 0 without GPUs
    "comm_ratio",         # log10(1 + moving its output over the slowest link / its fastest time) / 3,
                          # clipped to 1; 0 without GPUs (what placing it away from its consumers costs)
    # the best heuristic's plan (opsched.policies.hints; 0 when none was given): the policy's starting point
    "hint_device",        # (its device index + 1) / MAX_DEVICES
    "hint_level",         # (its thread-level index on that device + 1) / MAX_LEVELS
    "hint_threads",       # its threads / its device's slots
    "hint_order",         # 1 - its place in the heuristic's dispatch order / ops (1 = first)
)
#: Per-op dynamic state (columns of obs["node_dynamic"]).
DYNAMIC_FEATURES: tuple[str, ...] = (
    "waiting", "ready", "running", "done",   # one-hot state
    "device_frac",        # (device index + 1) / MAX_DEVICES once started, else 0
    "threads_frac",       # threads / device slots once started, else 0
    "remaining",          # running ops: predicted time to finish (transfer wait included) / reference,
                          # clipped to 1; else 0
    "hint_free",          # 1 for a ready op the best heuristic's plan would start now (its holds are done)
)
#: Per-device hardware state (obs["hardware"] has MAX_DEVICES rows of these;
#: rows of absent devices are all 0).
HARDWARE_FEATURES: tuple[str, ...] = (
    "present",            # 1 if the machine has this device
    "is_gpu",
    "log_cores",          # log2(slots) / 7, clipped to 1
    "free_frac",          # free slots / slots
    "busy_until",         # (latest predicted end of an op running there - now) / reference, clipped to 1
    "mem_frac",           # bytes of live tensors there / device memory (clipped to 1)
    "log_gflops",         # log10(peak GFLOP/s of one slot for a CPU, of the device for a GPU) / 5
    "log_bandwidth",      # log10(memory GB/s) / 4, clipped to 1
    "log_link_host",      # a GPU's link to the CPU: log10(GB/s) / 3, clipped to [0, 1]; 0 for the CPU
    "log_link_peer",      # a GPU's mean link to the other GPUs (through the host if no direct one), same scale
)
#: Global scalars (obs["globals"]).
GLOBAL_FEATURES: tuple[str, ...] = (
    "time",               # now / (now + reference): 0 at the start, 0.5 at one reference, -> 1
    "frac_done",          # ops done / ops
    "frac_ready",         # ready ops / ops
    "log_nodes",          # log2(ops in the (coarsened) graph) / 10, clipped to 1
)


def hint_columns(node_static: Any) -> tuple[Any, Any, Any]:
    """From ``node_static`` rows (numpy or torch, any leading axes): each op's
    hinted flat action column ``device * MAX_LEVELS + level`` (-1 where no
    hint), whether it has a hint, and its ``hint_order``; what the policy's
    prior reads (gated by :func:`hint_gate`)."""
    col = STATIC_FEATURES.index("hint_device")
    dev = (node_static[..., col] * MAX_DEVICES).round() - 1
    lvl = (node_static[..., STATIC_FEATURES.index("hint_level")] * MAX_LEVELS).round() - 1
    order = node_static[..., STATIC_FEATURES.index("hint_order")]
    flat = dev * MAX_LEVELS + lvl
    return flat, dev >= 0, order


def hint_gate(node_static: Any, node_dynamic: Any, hardware: Any) -> Any:
    """1 for the ops the hinted plan would start now: ready, its holds done
    (``hint_free``), and its hinted thread count fits in its device's free
    slots (the plan's own dispatch rule); 0 elsewhere.  numpy or torch, with
    matching leading axes (``hardware``: (..., MAX_DEVICES, features))."""
    free = node_dynamic[..., DYNAMIC_FEATURES.index("hint_free")]
    dev = (node_static[..., STATIC_FEATURES.index("hint_device")] * MAX_DEVICES).round() - 1
    want = node_static[..., STATIC_FEATURES.index("hint_threads")]
    have = hardware[..., HARDWARE_FEATURES.index("free_frac")]
    idx = dev.clip(0, MAX_DEVICES - 1)
    if type(node_static).__module__.split(".")[0] == "torch":  # the training encoder (batched tensors)
        got = have.gather(-1, idx.long())
        return free * (dev >= 0).to(free.dtype) * (want <= got + 1e-6).to(free.dtype)
    got = np.take_along_axis(have, idx.astype(np.int64), axis=-1)
    return free * (dev >= 0) * (want <= got + 1e-6)


_HINT_FREE = DYNAMIC_FEATURES.index("hint_free")
_FREE_FRAC = HARDWARE_FEATURES.index("free_frac")


class EpisodeHintGate:
    """:func:`hint_gate` for one episode's ops (numpy, no leading axes), with
    the static half - each op's hinted device and thread share - computed once:
    the decoder asks for the gate at every decision."""

    def __init__(self, node_static: np.ndarray) -> None:
        dev = (node_static[..., STATIC_FEATURES.index("hint_device")] * MAX_DEVICES).round() - 1
        self.has = dev >= 0
        self.idx = dev.clip(0, MAX_DEVICES - 1).astype(np.int64)
        self.want = node_static[..., STATIC_FEATURES.index("hint_threads")]

    def __call__(self, node_dynamic: np.ndarray, hardware: np.ndarray) -> np.ndarray:
        """The gate for ``node_dynamic`` (n, F) and ``hardware`` (MAX_DEVICES, F): hint_gate's values."""
        got = hardware[:, _FREE_FRAC][self.idx]
        return node_dynamic[:, _HINT_FREE] * self.has * (self.want <= got + 1e-6)


def obs_shapes(max_nodes: int, max_edges: int) -> dict[str, tuple[int, ...]]:
    """The logical shape of each observation key (see :data:`OBS_KEYS`).

    The Gymnasium environment hands every key over flattened (row-major 1-D
    ``Box``es: what SB3's and Gymnasium's checkers expect of a Dict space);
    :func:`unflatten_obs` restores these shapes."""
    n, e = int(max_nodes), int(max_edges)
    return {
        "node_static": (n, len(STATIC_FEATURES)), "node_dynamic": (n, len(DYNAMIC_FEATURES)), "node_mask": (n,),
        "edge_index": (2, e), "edge_mask": (e,), "hardware": (MAX_DEVICES, len(HARDWARE_FEATURES)),
        "globals": (len(GLOBAL_FEATURES),), LEVEL_KEY: (n, MAX_LEVELS),
    }


def flatten_obs(obs: Mapping[str, Any]) -> dict[str, Any]:
    """Every key as a 1-D array (row-major), as the environment observes."""
    return {k: v.reshape(-1) for k, v in obs.items()}


def unflatten_obs(obs: Mapping[str, Any], max_nodes: int, max_edges: int, batch: bool = False) -> dict[str, Any]:
    """The observation with its logical shapes (numpy arrays or torch tensors;
    already shaped ones pass unchanged); ``batch``: a leading batch axis."""
    shapes = obs_shapes(max_nodes, max_edges)
    if batch:
        return {k: v.reshape(v.shape[0], *shapes[k]) if k in shapes else v for k, v in obs.items()}
    return {k: v.reshape(shapes[k]) if k in shapes else v for k, v in obs.items()}


@dataclass(frozen=True)
class ActionLayout:
    max_nodes: int

    @property
    def n(self) -> int:
        """Size of the Discrete action space."""
        return self.max_nodes * MAX_DEVICES * MAX_LEVELS + 1

    @property
    def wait(self) -> int:
        return self.max_nodes * MAX_DEVICES * MAX_LEVELS

    def encode(self, slot: int, device: int, level: int) -> int:
        if not (0 <= slot < self.max_nodes and 0 <= device < MAX_DEVICES and 0 <= level < MAX_LEVELS):
            raise ValueError(f"action parts out of range: slot={slot} device={device} level={level}")
        return (slot * MAX_DEVICES + device) * MAX_LEVELS + level

    def decode(self, action: int) -> tuple[int, int, int] | None:
        """(slot, device, level), or None for wait."""
        action = int(action)
        if action == self.wait:
            return None
        if not 0 <= action < self.wait:
            raise ValueError(f"action {action} outside 0..{self.wait}")
        slot, rest = divmod(action, MAX_DEVICES * MAX_LEVELS)
        device, level = divmod(rest, MAX_LEVELS)
        return slot, device, level
