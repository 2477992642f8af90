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
``thread_levels()``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The most devices a machine may have for the env (host CPU + 7 GPUs).
MAX_DEVICES = 8
#: The most thread levels per device (1, 2, 4, ..., 64, all cores) = 8.
MAX_LEVELS = 8

#: Per-op static features (columns of obs["node_static"]).
STATIC_FEATURES: tuple[str, ...] = (
    # one-hot kind, 11 columns, in opsched.graph.OP_KINDS order
    "kind_conv", "kind_matmul", "kind_elementwise", "kind_pool", "kind_norm", "kind_concat_split",
    "kind_reduce", "kind_embedding", "kind_rnn", "kind_attention", "kind_other",
    "log_flops",          # log10(1 + flops) / 12
    "log_bytes",          # log10(1 + bytes read + written) / 10
    "time_1",             # predicted time on the CPU at 1 thread / reference time
    "scaling",            # time at all CPU cores / time at 1 thread (1 = no speed-up)
    "best_time",          # fastest predicted time over devices and levels / reference time
    "upward_rank",        # upward rank (fastest times) / critical path length
    "in_degree",          # in-degree / 8 (clipped to 1)
    "out_degree",         # out-degree / 8 (clipped to 1)
)
#: Per-op dynamic state (columns of obs["node_dynamic"]).
DYNAMIC_FEATURES: tuple[str, ...] = (
    "waiting", "ready", "running", "done",   # one-hot state
    "device_frac",        # (device index + 1) / MAX_DEVICES when started, else 0
    "threads_frac",       # threads / device cores when started, else 0
    "remaining",          # remaining predicted time / reference time (running ops), else 0
)
#: Per-device hardware state (obs["hardware"] has MAX_DEVICES rows of these).
HARDWARE_FEATURES: tuple[str, ...] = (
    "present",            # 1 if the machine has this device
    "is_gpu",
    "log_cores",          # log2(cores) / 7
    "free_frac",          # free slots / slots
    "busy_until",         # (latest end of a running op - now) / reference time
    "mem_frac",           # memory held by live tensors / device memory (clipped to 1)
    "log_gflops",         # log10(peak GFLOP/s) / 5
    "log_bandwidth",      # log10(memory GB/s) / 4
)
#: Global scalars (obs["globals"]).
GLOBAL_FEATURES: tuple[str, ...] = (
    "time",               # current time / reference time
    "frac_done",          # ops done / ops
    "frac_ready",         # ready ops / ops
    "log_nodes",          # log2(ops) / 10
)


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
