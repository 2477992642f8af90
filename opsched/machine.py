"""Machines: the devices a plan places ops on, and the links between them.

A :class:`Machine` has one host CPU device (``"cpu"``) and zero or more GPUs
(``"gpu:0"``, ``"gpu:1"`` …).  Capacities are in *slots*:

* a CPU device has one slot per physical core; an op asks for ``threads`` of
  them (its intra-op thread count);
* a GPU device has one slot per concurrent stream (``streams``, default 4); an
  op on a GPU always takes exactly one slot (``threads == 1``): kernels that
  co-run on one GPU share its SMs, which the performance model prices as
  interference rather than as thread counts.

Presets describe the machines of the seed papers so the simulator can run
them anywhere; each documents its sources.  ``Machine.probe()`` reads the
machine it runs on.  A user's own machine can be written in YAML (see
``Machine.from_yaml``; ``opsched machine NAME --yaml`` prints a commented
template that loads back unchanged).

Every field is checked where a :class:`Device` or :class:`Link` is made, not
where it is first used: a machine is an input users type by hand, and a wrong
type or a NaN there used to surface as a traceback deep in planning.  Counts
(``cores``, ``sockets``, ``smt``) are whole numbers (a bool is not one),
speeds and sizes finite numbers in range; :class:`~opsched.errors.MachineError`
names the device or link, the field and, for a file, the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from opsched.errors import MachineError

#: What each field of a device means, with its unit (error messages and the YAML template).
DEVICE_FIELDS: dict[str, str] = {
    "id": "'cpu' for the host CPU; 'gpu:0', 'gpu:1', ... for GPUs",
    "kind": "cpu or gpu",
    "cores": "CPU: physical cores (the slots intra-op threads take); GPU: concurrent streams",
    "gflops": "peak FP32 GFLOP/s: per core for a CPU, of the whole device for a GPU",
    "mem_bandwidth_gbs": "memory bandwidth, GB/s (a CPU: all cores and sockets together)",
    "memory_gb": "memory, GB (0: unknown)",
    "sockets": "CPU sockets the cores are spread over (1 for a GPU)",
    "smt": "hardware threads per core (2 with hyper-threading); plans use physical cores",
    "name": "free text: the model name",
    "busy_cores": "CPU: cores busy with other work on average (the machine's load; 0: idle)",
}
#: Fields a device must give (the others have defaults).
DEVICE_REQUIRED = ("id", "kind", "cores", "gflops", "mem_bandwidth_gbs", "memory_gb")
#: What each field of a link means.
LINK_FIELDS: dict[str, str] = {
    "a": "one end: a device id",
    "b": "the other end: a device id (links work both ways)",
    "bandwidth_gbs": "GB/s in each direction",
    "latency_us": "microseconds added to every transfer",
}
MACHINE_FIELDS = ("name", "description", "source", "devices", "links")


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _whole(where: str, field_name: str, value: Any, low: int) -> int:
    """``value`` as an int >= ``low``; bools, floats and strings are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise MachineError(f"{where}: {field_name} must be a whole number >= {low}, got {_shown(value)}")
    if value < low:
        raise MachineError(f"{where}: {field_name} must be a whole number >= {low}, got {value!r}")
    return int(value)


def _real(where: str, field_name: str, value: Any, positive: bool) -> float:
    """``value`` as a finite float, > 0 (``positive``) or >= 0; bools and strings are refused."""
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise MachineError(f"{where}: {field_name} must be a finite number {bound}, got {_shown(value)}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise MachineError(f"{where}: {field_name} must be a finite number {bound}, got {value!r}")
    return v


@dataclass(frozen=True)
class Device:
    """One device.  Speeds are nominal peak figures; the profiler measures real ones.

    ``gflops`` is the peak single-precision GFLOP/s of *one* slot for a CPU (a
    core) and of the whole device for a GPU; ``mem_bandwidth_gbs`` the
    device's memory bandwidth in GB/s (all cores of a CPU together).
    """

    id: str
    kind: str  # "cpu" | "gpu"
    cores: int  # CPU: physical cores; GPU: concurrent streams
    gflops: float
    mem_bandwidth_gbs: float
    memory_gb: float
    sockets: int = 1
    smt: int = 1
    name: str = ""
    #: Cores taken by other work (the machine's load, on average); 0 = an idle machine.  The
    #: simulator shares the cores between the plan's threads and this load (``opsched.engine.sim``).
    busy_cores: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id.strip():
            raise MachineError(f"a device's id must be a non-empty string, got {_shown(self.id)}")
        where = f"device {self.id!r}"
        if self.kind not in ("cpu", "gpu"):
            raise MachineError(f"{where}: kind must be 'cpu' or 'gpu', got {self.kind!r}")
        if not isinstance(self.name, str):
            raise MachineError(f"{where}: name must be a string, got {_shown(self.name)}")
        checked = {
            "cores": _whole(where, "cores", self.cores, 1),
            "sockets": _whole(where, "sockets", self.sockets, 1),
            "smt": _whole(where, "smt", self.smt, 1),
            "gflops": _real(where, "gflops", self.gflops, positive=True),
            "mem_bandwidth_gbs": _real(where, "mem_bandwidth_gbs", self.mem_bandwidth_gbs, positive=True),
            "memory_gb": _real(where, "memory_gb", self.memory_gb, positive=False),
            "busy_cores": _real(where, "busy_cores", self.busy_cores, positive=False),
        }
        if checked["busy_cores"] and (self.kind == "gpu" or checked["busy_cores"] >= checked["cores"]):
            raise MachineError(f"{where}: busy_cores must be below cores ({self.cores}) and 0 on a GPU, "
                               f"got {self.busy_cores!r}")
        if checked["sockets"] > checked["cores"]:
            raise MachineError(f"{where}: sockets ({self.sockets}) cannot exceed cores ({self.cores})")
        for key, value in checked.items():  # canonical types: 8 and 8.0 give one fingerprint
            object.__setattr__(self, key, value)

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    def thread_levels(self) -> tuple[int, ...]:
        """The thread counts a plan may give an op here: powers of two up to the
        core count, plus the core count itself (GPUs: just 1)."""
        if self.is_gpu:
            return (1,)
        levels = []
        t = 1
        while t < self.cores:
            levels.append(t)
            t *= 2
        levels.append(self.cores)
        return tuple(levels)

    @property
    def cores_per_socket(self) -> int:
        return max(1, self.cores // max(1, self.sockets))


@dataclass(frozen=True)
class Link:
    """A data path between two devices (both directions): bandwidth and latency."""

    a: str
    b: str
    bandwidth_gbs: float
    latency_us: float

    def __post_init__(self) -> None:
        for end in (self.a, self.b):
            if not isinstance(end, str) or not end.strip():
                raise MachineError(f"link {self.a!r}-{self.b!r}: each end must be a device id (a string), "
                                   f"got {_shown(end)}")
        where = f"link {self.a}-{self.b}"
        if self.a == self.b:
            raise MachineError(f"{where}: a link joins two different devices")
        object.__setattr__(self, "bandwidth_gbs", _real(where, "bandwidth_gbs", self.bandwidth_gbs, positive=True))
        object.__setattr__(self, "latency_us", _real(where, "latency_us", self.latency_us, positive=False))


@dataclass(frozen=True, eq=True)
class Machine:
    name: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...] = ()
    description: str = ""
    source: str = ""  # where the figures come from (papers, datasheets, probe)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(self.links))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`MachineError` unless the devices and links fit together
        (each device and link checked its own fields when it was made)."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise MachineError(f"a machine's name must be a non-empty string, got {_shown(self.name)}")
        for key in ("description", "source"):
            if not isinstance(getattr(self, key), str):
                raise MachineError(f"machine {self.name!r}: {key} must be a string, got {_shown(getattr(self, key))}")
        for d in self.devices:
            if not isinstance(d, Device):
                raise MachineError(f"machine {self.name!r}: devices must be Device objects, got {_shown(d)}")
        for link in self.links:
            if not isinstance(link, Link):
                raise MachineError(f"machine {self.name!r}: links must be Link objects, got {_shown(link)}")
        ids = [d.id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise MachineError(f"machine {self.name!r}: duplicate device ids {ids}")
        if "cpu" not in ids:
            raise MachineError(f"machine {self.name!r}: needs a host device with id 'cpu'")
        for d in self.devices:
            if d.id == "cpu" and d.kind != "cpu":
                raise MachineError(f"machine {self.name!r}: device 'cpu' (the host) must have kind 'cpu'")
        pairs: set[frozenset[str]] = set()
        for link in self.links:
            for end in (link.a, link.b):
                if end not in ids:
                    raise MachineError(f"machine {self.name!r}: link {link.a}-{link.b} refers to unknown device "
                                       f"{end!r} (devices: {', '.join(ids)})")
            pair = frozenset((link.a, link.b))
            if pair in pairs:
                raise MachineError(f"machine {self.name!r}: two links between {link.a} and {link.b}")
            pairs.add(pair)

    # ------------------------------------------------------------------ lookup
    @cached_property
    def device_index(self) -> dict[str, int]:
        return {d.id: i for i, d in enumerate(self.devices)}

    def device(self, device_id: str) -> Device:
        try:
            return self.devices[self.device_index[device_id]]
        except KeyError:
            raise MachineError(
                f"machine {self.name!r} has no device {device_id!r} (it has {', '.join(self.device_index)})"
            ) from None

    @property
    def cpu(self) -> Device:
        return self.device("cpu")

    @property
    def gpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.is_gpu)

    def link(self, a: str, b: str) -> Link | None:
        """The link between two devices; ``None`` for a device and itself.

        Two GPUs with no direct link talk through the host: the slower of their
        two host links, with both latencies."""
        if a == b:
            return None
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        if a != "cpu" and b != "cpu":
            la, lb = self.link(a, "cpu"), self.link(b, "cpu")
            if la and lb:
                return Link(a, b, min(la.bandwidth_gbs, lb.bandwidth_gbs), la.latency_us + lb.latency_us)
        raise MachineError(f"machine {self.name!r}: no link between {a!r} and {b!r}")

    def transfer_time(self, nbytes: float, a: str, b: str) -> float:
        """Seconds to move ``nbytes`` from device ``a`` to ``b`` (0 on one device)."""
        link = self.link(a, b)
        if link is None:
            return 0.0
        return link.latency_us * 1e-6 + nbytes / (link.bandwidth_gbs * 1e9)

    def cpu_only(self) -> Machine:
        """This machine without its GPUs (the CPU runtimes run every op on the CPU;
        their profiles and runtime models are keyed by this machine)."""
        if not self.gpus:
            return self
        return Machine(name=self.name, devices=(self.cpu,), links=(),
                       description=f"{self.description} (CPU only)", source=self.source)

    @property
    def total_cores(self) -> int:
        return sum(d.cores for d in self.devices if not d.is_gpu)

    # ---------------------------------------------------------------- identity
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "devices": [_device_dict(d) for d in self.devices],
            "links": [asdict(link) for link in self.links],
        }

    def fingerprint(self) -> str:
        """Stable hash of what matters to a schedule: devices and links (with the load of
        busy cores, when there is any), not prose."""
        body = {"devices": self.to_dict()["devices"], "links": self.to_dict()["links"]}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def loaded(self) -> bool:
        """Some of its cores are busy with other work (``busy_cores`` > 0 on a device)."""
        return any(d.busy_cores for d in self.devices)

    def at_rest(self) -> Machine:
        """The same hardware with no core busy: what a plan names as its machine."""
        if not self.loaded:
            return self
        return dataclasses.replace(self, devices=tuple(dataclasses.replace(d, busy_cores=0.0) for d in self.devices))

    def hardware_fingerprint(self) -> str:
        """The fingerprint of the hardware alone (:meth:`at_rest`): what a Plan records and is
        checked against, so a plan made while some cores were busy still runs on the idle
        machine, and the other way round (the load changes which plan is best, not which
        plans are valid)."""
        return self.at_rest().fingerprint()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "<dict>") -> Machine:
        """A machine from its description (``to_dict``'s or a YAML file's);
        every field is checked, and an error names ``where``, the device or
        link and the field."""
        if not isinstance(data, Mapping):
            raise MachineError(f"{where}: a machine description is a mapping with 'devices', got {_shown(data)}")
        unknown = [k for k in data if k not in MACHINE_FIELDS]
        if unknown:
            raise MachineError(f"{where}: unknown key {unknown[0]!r}; a machine has {', '.join(MACHINE_FIELDS)}")
        raw_devices = data.get("devices")
        if not isinstance(raw_devices, list) or not raw_devices:
            raise MachineError(f"{where}: 'devices' must be a non-empty list of devices (the host 'cpu' first), "
                               f"got {_shown(raw_devices)}")
        raw_links = data.get("links") or []
        if not isinstance(raw_links, list):
            raise MachineError(f"{where}: 'links' must be a list of links, got {_shown(raw_links)}")
        devices = tuple(_make(Device, d, f"devices[{k}]", DEVICE_FIELDS, DEVICE_REQUIRED, where)
                        for k, d in enumerate(raw_devices))
        links = tuple(_make(Link, lk, f"links[{k}]", LINK_FIELDS, tuple(LINK_FIELDS), where)
                      for k, lk in enumerate(raw_links))
        text = {}
        for key, default in (("name", Path(where).stem), ("description", ""), ("source", where)):
            value = data.get(key, default)
            if value is None:
                value = default
            if not isinstance(value, str):
                raise MachineError(f"{where}: {key} must be a string, got {_shown(value)}")
            text[key] = value
        try:
            return cls(devices=devices, links=links, **text)
        except MachineError as exc:
            raise MachineError(f"{where}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> Machine:
        import yaml

        p = Path(path)
        try:
            data = yaml.load(p.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except FileNotFoundError:
            raise MachineError(f"{p}: no such machine file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise MachineError(f"{p}: cannot read the machine file ({exc})") from None
        except yaml.YAMLError as exc:
            raise MachineError(f"{p}: not valid YAML ({exc})") from None
        if not isinstance(data, Mapping):
            raise MachineError(f"{p}: expected a mapping with 'devices' (see `opsched machine knl-68 --yaml`)")
        return cls.from_dict(data, where=str(p))

    def to_yaml(self, comments: bool = True) -> str:
        """This machine as YAML that :meth:`from_yaml` reads back unchanged; with
        ``comments`` (the default) a template for your own: every field
        explained, with its unit."""
        import yaml

        if not comments:
            return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)
        d = self.to_dict()
        out = [
            "# An opsched machine.  Edit the figures, then pass --machine FILE.yaml to any command.",
            "# Units: GFLOP/s, GB/s, GB, microseconds.  One host device with id 'cpu' (kind cpu), then",
            "# any GPUs ('gpu:0', 'gpu:1', ...).  Every field is checked when the file is read.",
            f"name: {_scalar(d['name'])}",
            "# what the figures describe, and where they come from (free text)",
            f"description: {_scalar(d['description'])}",
            f"source: {_scalar(d['source'])}",
            "devices:",
        ]
        explained: set[str] = set()
        for dev in d["devices"]:
            notes = _device_notes(dev["kind"]) if dev["kind"] not in explained else {}
            explained.add(dev["kind"])
            out += _yaml_entry(dev, notes)
        if d["links"]:
            out.append("# data paths between devices, both directions (two GPUs without one talk through 'cpu')")
            out.append("links:")
            for k, link in enumerate(d["links"]):
                out += _yaml_entry(link, LINK_FIELDS if k == 0 else {})
        else:
            out.append("links: []  # data paths between devices: none on a CPU-only machine")
        return "\n".join(out) + "\n"

    # ------------------------------------------------------------------ probe
    @classmethod
    def probe(cls, load: bool = False) -> Machine:
        """Describe the machine this process runs on.

        ``load``: also sample how many cores other processes keep busy right now
        (:func:`sample_busy_cores`, a quarter of a second) into the CPU's
        ``busy_cores``, which the simulator prices (a thread team wider than the
        free cores waits at every barrier for its member on a busy core) and so
        every policy plans with.

        Cores are the *physical* cores this process may use (affinity-aware:
        ``sched_getaffinity`` intersected with /proc/cpuinfo's core ids); GPUs
        come from ``torch.cuda`` when torch is importable and sees one.  Speeds
        are nominal (the profiler measures real op times); they are not in the
        fingerprint's way of changing because they are constants here."""
        logical, physical, sockets, model = _probe_cpu()
        smt = max(1, logical // max(1, physical))
        busy = sample_busy_cores(physical) if load else 0.0
        cpu = Device(
            id="cpu",
            kind="cpu",
            cores=physical,
            gflops=50.0,
            mem_bandwidth_gbs=20.0,
            memory_gb=round(_probe_memory_gb(), 1),
            sockets=sockets,
            smt=smt,
            name=model,
            busy_cores=busy,
        )
        devices = [cpu]
        links = []
        for i, (gname, mem_gb) in enumerate(_probe_gpus()):
            devices.append(
                Device(id=f"gpu:{i}", kind="gpu", cores=4, gflops=20000.0, mem_bandwidth_gbs=1000.0,
                       memory_gb=round(mem_gb, 1), name=gname)
            )
            links.append(Link("cpu", f"gpu:{i}", 12.0, 10.0))
        return cls(
            name="local",
            devices=tuple(devices),
            links=tuple(links),
            description=f"this machine ({platform.node() or 'unknown host'}): {model}",
            source="Machine.probe()",
        )


def _device_dict(device: Device) -> dict[str, Any]:
    """A device's fields; ``busy_cores`` only on a loaded machine, so an idle
    machine's description and fingerprint are what they were before the field."""
    d = asdict(device)
    if not d["busy_cores"]:
        del d["busy_cores"]
    return d


def _make(cls: type, raw: Any, label: str, fields_doc: Mapping[str, str], required: tuple[str, ...],
          where: str) -> Any:
    """A Device or Link from one entry of a machine file, with errors naming the entry."""
    if not isinstance(raw, Mapping):
        raise MachineError(f"{where}: {label} must be a mapping of fields, got {_shown(raw)}")
    if isinstance(raw.get("id"), str):
        label = f"{label} ({raw['id']!r})"
    for key in raw:
        if key not in fields_doc:
            raise MachineError(f"{where}: {label}: unknown field {key!r}; the fields are {', '.join(fields_doc)}")
    for key in required:
        if key not in raw:
            raise MachineError(f"{where}: {label}: missing field {key!r} ({fields_doc[key]})")
    try:
        return cls(**raw)
    except MachineError as exc:
        raise MachineError(f"{where}: {exc}") from None


def _device_notes(kind: str) -> dict[str, str]:
    """The template's comments for a device of ``kind``: what each field means there."""
    notes = dict(DEVICE_FIELDS)
    if kind == "cpu":
        notes.update(cores="physical cores: the slots intra-op threads take", sockets="CPU sockets (NUMA nodes)",
                     gflops="peak FP32 GFLOP/s of ONE core (not of the whole CPU)",
                     mem_bandwidth_gbs="memory bandwidth in GB/s, all cores and sockets together")
    else:
        notes.update(cores="concurrent streams (an op on a GPU takes one)", sockets="1 for a GPU",
                     smt="1 for a GPU", gflops="peak FP32 GFLOP/s of the whole GPU",
                     mem_bandwidth_gbs="device memory bandwidth in GB/s")
    return notes


def _yaml_entry(entry: Mapping[str, Any], notes: Mapping[str, str]) -> list[str]:
    """One list entry (a device or a link) as YAML lines, each field with its note."""
    lines = [f"  {'- ' if k == 0 else '  '}{key}: {_scalar(value)}" for k, (key, value) in enumerate(entry.items())]
    width = max(len(line) for line in lines)
    return [f"{line.ljust(width)}  # {notes[key]}" if key in notes else line
            for line, key in zip(lines, entry)]


def _scalar(value: Any) -> str:
    """One YAML scalar, quoted where YAML needs it (PyYAML's own representer)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=False, width=1 << 30)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _probe_cpu() -> tuple[int, int, int, str]:
    """(usable logical CPUs, usable physical cores, sockets, model name): :func:`opsched.timing.cpu_topology`."""
    from opsched.timing import cpu_topology

    return cpu_topology()


#: Sampling window of :func:`sample_busy_cores`, and the share of a core other work must keep
#: busy before it counts as a busy core (a quarter core of background noise is no load).
LOAD_WINDOW_S, BUSY_THRESHOLD = 0.25, 0.5


def sample_busy_cores(cores: int, window_s: float = LOAD_WINDOW_S) -> float:
    """Whole cores other processes keep busy now: their CPU use over ``window_s`` rounded to the
    nearest core (0 below :data:`BUSY_THRESHOLD`), at most ``cores - 1``."""
    import time

    from opsched.timing import ContentionMeter

    with ContentionMeter() as meter:
        time.sleep(window_s)
    others = meter.others_cores
    if others < BUSY_THRESHOLD or cores < 2:
        return 0.0
    return float(min(cores - 1, int(others + 0.5)))


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, read by :func:`_probe_cpu`), else ``platform.processor()``."""
    return _probe_cpu()[3]


def _probe_memory_gb() -> float:
    import psutil

    try:
        return psutil.virtual_memory().total / 1024**3
    except (psutil.Error, OSError):
        return 0.0


def _probe_gpus() -> list[tuple[str, float]]:
    """(name, GiB) of each CUDA device torch sees.  Without NVIDIA's device
    nodes or driver there can be none, and torch is not imported: probing this
    machine (the env's default) then stays cheap and torch-free."""
    import glob

    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.isdir("/proc/driver/nvidia") \
            and "torch" not in sys.modules:
        return []
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append((props.name, props.total_memory / 1024**3))
    return out


# --------------------------------------------------------------------- presets
#: The presets, as YAML files in the format of ``--machine FILE.yaml`` (each with
#: the sources of its figures): the papers' machines and three GPU servers.
PRESET_DIR = Path(__file__).with_name("presets")
PRESET_NAMES = ("knl-68", "xeon-8180-2s", "dgx1-4v100", "2x2080ti", "4xa6000")


def _presets() -> dict[str, Machine]:
    return {name: Machine.from_yaml(PRESET_DIR / f"{name}.yaml") for name in PRESET_NAMES}


PRESETS: dict[str, Machine] = _presets()


def preset_names() -> list[str]:
    return ["local", *PRESETS]


#: The machine spec grammar, for error messages and ``--help``.
MACHINE_SPECS = ("a preset (" + ", ".join(["local", *PRESETS]) + "), local:load (this machine with the cores "
                 "other work keeps busy now), a machine YAML file, or "
                 "cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS] (a CPU-only machine)")


def get_machine(spec: str | Machine | None = None) -> Machine:
    """The machine a spec names: ``"local"`` (this machine, probed; the
    default), a preset name, a YAML file, or ``cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS]``
    (a CPU-only machine, e.g. for training on many core counts)."""
    if isinstance(spec, Machine):
        return spec
    if spec in (None, "local", "probe"):
        return Machine.probe()
    if spec == "local:load":
        return Machine.probe(load=True)
    if not isinstance(spec, str) or not spec.strip():
        raise MachineError(f"a machine spec is a string, got {spec!r}; {MACHINE_SPECS}")
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.startswith("cpu:"):
        return _cpu_machine(spec)
    if spec.endswith((".yml", ".yaml")) or Path(spec).exists():
        return Machine.from_yaml(spec)
    raise MachineError(f"unknown machine {spec!r}; {MACHINE_SPECS}")


def _cpu_machine(spec: str) -> Machine:
    """``cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS]``."""
    form = "cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS]"
    parts = spec.split(":")[1:]
    if len(parts) not in (3, 4):
        raise MachineError(f"machine spec {spec!r}: expected {form} (3 or 4 fields after 'cpu:', got {len(parts)})")
    names = ("CORES", "GFLOPS_PER_CORE", "MEM_GBS", "SOCKETS")
    values: list[Any] = []
    for name, text in zip(names, parts):
        try:
            values.append(int(text) if name in ("CORES", "SOCKETS") else float(text))
        except ValueError:
            kind = "a whole number" if name in ("CORES", "SOCKETS") else "a number"
            raise MachineError(f"machine spec {spec!r}: {name} must be {kind}, got {text!r} ({form})") from None
    cores, gflops, bandwidth = values[:3]
    sockets = values[3] if len(values) == 4 else 1
    try:
        device = Device(id="cpu", kind="cpu", cores=cores, gflops=gflops, mem_bandwidth_gbs=bandwidth,
                        memory_gb=64.0, sockets=sockets, name=f"{cores}-core {sockets}-socket CPU")
    except MachineError as exc:
        raise MachineError(f"machine spec {spec!r}: {exc} ({form})") from None
    return Machine(name=spec.replace(":", "-"), devices=(device,), description="CPU-only machine",
                   source="opsched.machine cpu: spec")
