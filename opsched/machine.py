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
``Machine.from_yaml``; the README shows the format).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from opsched.errors import MachineError


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
        ids = [d.id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise MachineError(f"machine {self.name!r}: duplicate device ids {ids}")
        if "cpu" not in ids:
            raise MachineError(f"machine {self.name!r}: needs a host device with id 'cpu'")
        for d in self.devices:
            if d.kind not in ("cpu", "gpu"):
                raise MachineError(f"machine {self.name!r}: device {d.id!r} has unknown kind {d.kind!r}")
            if d.cores < 1 or d.gflops <= 0 or d.mem_bandwidth_gbs <= 0:
                raise MachineError(
                    f"machine {self.name!r}: device {d.id!r} needs cores >= 1 and positive gflops and bandwidth"
                )
        for link in self.links:
            for end in (link.a, link.b):
                if end not in ids:
                    raise MachineError(f"machine {self.name!r}: link refers to unknown device {end!r}")
            if link.bandwidth_gbs <= 0 or link.latency_us < 0:
                raise MachineError(f"machine {self.name!r}: link {link.a}-{link.b} has bad figures")

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
            "devices": [asdict(d) for d in self.devices],
            "links": [asdict(link) for link in self.links],
        }

    def fingerprint(self) -> str:
        """Stable hash of what matters to a schedule: devices and links, not prose."""
        body = {"devices": self.to_dict()["devices"], "links": self.to_dict()["links"]}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "<dict>") -> Machine:
        try:
            devices = tuple(Device(**d) for d in data["devices"])
            links = tuple(Link(**lk) for lk in data.get("links", ()))
        except (KeyError, TypeError) as exc:
            raise MachineError(f"{where}: malformed machine description: {exc}") from None
        return cls(
            name=str(data.get("name", Path(where).stem)),
            devices=devices,
            links=links,
            description=str(data.get("description", "")),
            source=str(data.get("source", where)),
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> Machine:
        import yaml

        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text())
        except FileNotFoundError:
            raise MachineError(f"{p}: no such machine file") from None
        except yaml.YAMLError as exc:
            raise MachineError(f"{p}: not valid YAML ({exc})") from None
        if not isinstance(data, Mapping):
            raise MachineError(f"{p}: expected a mapping with 'devices'")
        return cls.from_dict(data, where=str(p))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ------------------------------------------------------------------ probe
    @classmethod
    def probe(cls) -> Machine:
        """Describe the machine this process runs on.

        Cores are the *physical* cores this process may use (affinity-aware:
        ``sched_getaffinity`` intersected with /proc/cpuinfo's core ids); GPUs
        come from ``torch.cuda`` when torch is importable and sees one.  Speeds
        are nominal (the profiler measures real op times); they are not in the
        fingerprint's way of changing because they are constants here."""
        logical, physical, sockets, model = _probe_cpu()
        smt = max(1, logical // max(1, physical))
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


def _probe_cpu() -> tuple[int, int, int, str]:
    """(usable logical CPUs, usable physical cores, sockets, model name)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    model = platform.processor() or "cpu"
    cores: set[tuple[str, str]] = set()
    sockets: set[str] = set()
    try:
        blocks = Path("/proc/cpuinfo").read_text().strip().split("\n\n")
        for block in blocks:
            info = dict(
                (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in block.splitlines())
            )
            if int(info.get("processor", -1)) not in allowed:
                continue
            model = info.get("model name", model)
            phys = info.get("physical id", "0")
            sockets.add(phys)
            cores.add((phys, info.get("core id", info.get("processor", "0"))))
    except (OSError, ValueError):
        pass
    physical = len(cores) or len(allowed)
    return len(allowed), physical, max(1, len(sockets)), model


def _probe_memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
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
def _gpu_machine(name: str, n_gpus: int, gpu: dict[str, Any], host: dict[str, Any],
                 host_link: tuple[float, float], peer_link: tuple[float, float] | None,
                 description: str, source: str) -> Machine:
    devices = [Device(id="cpu", kind="cpu", **host)]
    links = []
    for i in range(n_gpus):
        devices.append(Device(id=f"gpu:{i}", kind="gpu", **gpu))
        links.append(Link("cpu", f"gpu:{i}", *host_link))
    if peer_link:
        for i in range(n_gpus):
            for j in range(i + 1, n_gpus):
                links.append(Link(f"gpu:{i}", f"gpu:{j}", *peer_link))
    return Machine(name=name, devices=tuple(devices), links=tuple(links), description=description, source=source)


def _presets() -> dict[str, Machine]:
    knl = Machine(
        name="knl-68",
        devices=(
            Device(id="cpu", kind="cpu", cores=68, gflops=44.8, mem_bandwidth_gbs=400.0, memory_gb=16.0,
                   sockets=1, smt=4, name="Intel Xeon Phi 7250 (Knights Landing)"),
        ),
        description="68-core Intel Xeon Phi 7250 in flat MCDRAM mode, the machine of the Graphi paper",
        source=("Graphi (Tang et al., 2018) sec. 5; Intel ARK Xeon Phi 7250: 68 cores @1.4 GHz, "
                "2 AVX-512 VPUs -> 64 SP FLOP/cycle peak, derated to 32 sustained (44.8 GFLOP/s/core); "
                "MCDRAM ~400 GB/s stream"),
    )
    xeon = Machine(
        name="xeon-8180-2s",
        devices=(
            Device(id="cpu", kind="cpu", cores=56, gflops=121.6, mem_bandwidth_gbs=210.0, memory_gb=192.0,
                   sockets=2, smt=2, name="2x Intel Xeon Platinum 8180"),
        ),
        description="2-socket Intel Xeon Platinum 8180 (2x28 cores), a common TensorFlow CPU server",
        source=("Intel ARK Xeon Platinum 8180: 28 cores, AVX-512 all-core ~1.9 GHz x 64 SP FLOP/cycle = "
                "121.6 GFLOP/s/core; 6 DDR4-2666 channels per socket, ~105 GB/s stream per socket"),
    )
    dgx = _gpu_machine(
        "dgx1-4v100", 4,
        gpu=dict(cores=4, gflops=15700.0, mem_bandwidth_gbs=900.0, memory_gb=16.0, name="NVIDIA V100-SXM2-16GB"),
        host=dict(cores=40, gflops=70.4, mem_bandwidth_gbs=150.0, memory_gb=512.0, sockets=2, smt=2,
                  name="2x Intel Xeon E5-2698 v4"),
        host_link=(12.0, 10.0), peer_link=(25.0, 5.0),
        description="4 V100s of a DGX-1 with NVLink between them, one of NN Maestro's set-ups",
        source=("NN Maestro (4x V100); NVIDIA V100 datasheet: 15.7 TFLOP/s FP32, 900 GB/s HBM2; "
                "NVLink 2.0 25 GB/s per direction per link; host PCIe 3.0 x16 ~12 GB/s effective"),
    )
    rtx = _gpu_machine(
        "2x2080ti", 2,
        gpu=dict(cores=4, gflops=13450.0, mem_bandwidth_gbs=616.0, memory_gb=11.0, name="NVIDIA GeForce RTX 2080 Ti"),
        host=dict(cores=8, gflops=89.6, mem_bandwidth_gbs=40.0, memory_gb=64.0, name="8-core desktop CPU"),
        host_link=(12.0, 10.0), peer_link=(10.0, 15.0),
        description="2 RTX 2080 Ti over PCIe 3.0 (no NVLink), one of NN Maestro's set-ups",
        source=("NN Maestro (2x 2080Ti); NVIDIA Turing whitepaper: 13.4 TFLOP/s FP32, 616 GB/s GDDR6; "
                "PCIe 3.0 x16 ~12 GB/s to host, ~10 GB/s peer-to-peer through the switch"),
    )
    a6000 = _gpu_machine(
        "4xa6000", 4,
        gpu=dict(cores=4, gflops=38700.0, mem_bandwidth_gbs=768.0, memory_gb=48.0, name="NVIDIA RTX A6000"),
        host=dict(cores=32, gflops=80.0, mem_bandwidth_gbs=200.0, memory_gb=256.0, sockets=1, smt=2,
                  name="32-core workstation CPU"),
        host_link=(24.0, 8.0), peer_link=(20.0, 10.0),
        description="4 RTX A6000 over PCIe 4.0, one of NN Maestro's set-ups",
        source=("NN Maestro (4x A6000); NVIDIA RTX A6000 datasheet: 38.7 TFLOP/s FP32, 768 GB/s GDDR6, "
                "PCIe 4.0 x16 ~24 GB/s effective to host, ~20 GB/s peer-to-peer"),
    )
    return {m.name: m for m in (knl, xeon, dgx, rtx, a6000)}


PRESETS: dict[str, Machine] = _presets()


def preset_names() -> list[str]:
    return ["local", *PRESETS]


#: The machine spec grammar, for error messages and ``--help``.
MACHINE_SPECS = ("a preset (" + ", ".join(["local", *PRESETS]) + "), a machine YAML file, or "
                 "cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS] (a CPU-only machine)")


def get_machine(spec: str | Machine | None = None) -> Machine:
    """The machine a spec names: ``"local"`` (this machine, probed; the
    default), a preset name, a YAML file, or ``cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS]``
    (a CPU-only machine, e.g. for training on many core counts)."""
    if isinstance(spec, Machine):
        return spec
    if spec in (None, "local", "probe"):
        return Machine.probe()
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
    parts = spec.split(":")[1:]
    try:
        if len(parts) not in (3, 4):
            raise ValueError(spec)
        cores, sockets = int(parts[0]), int(parts[3]) if len(parts) == 4 else 1
        device = Device(id="cpu", kind="cpu", cores=cores, gflops=float(parts[1]), mem_bandwidth_gbs=float(parts[2]),
                        memory_gb=64.0, sockets=sockets, name=f"{cores}-core {sockets}-socket CPU")
    except (ValueError, TypeError) as exc:
        raise MachineError(f"machine spec {spec!r}: expected cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS] "
                           f"with whole numbers of cores and sockets ({exc})") from None
    return Machine(name=spec.replace(":", "-"), devices=(device,), description="CPU-only machine",
                   source="opsched.machine cpu: spec")
