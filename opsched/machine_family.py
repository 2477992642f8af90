"""A randomized family of machines, so a policy learns to read the hardware, not one machine.

``random:SEED`` (a machine spec, :func:`opsched.specs.load_machine`) is one
draw: half the draws are CPU-only machines (2 to 128 cores, 1, 2 or 4
sockets, SMT 1 or 2, per-core speed and memory bandwidth over the range of
laptops to manycore servers); the others pair a host CPU with 1 to 7 GPUs
(the environment's layout holds 8 devices, the CPU included) of a random
speed and memory bandwidth, linked to the host by PCIe-class links and to
each other either through the host or by NVLink-class peer links, so that
spreading work over the GPUs sometimes pays and sometimes does not.  The
presets (``opsched machine --list``) are never drawn: they are test machines.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opsched.errors import MachineError
from opsched.machine import Device, Link, Machine

#: Core counts a CPU of the family may have (<= 128: the environment's 8 thread levels).
CPU_CORES = (2, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 96, 128)
#: Most GPUs in a draw (the environment's layout: 8 devices including the CPU).
MAX_GPUS = 7


def gpu_machine(name: str, n_gpus: int, gpu: dict[str, Any], host: dict[str, Any],
                host_link: tuple[float, float], peer_link: tuple[float, float] | None,
                description: str, source: str) -> Machine:
    """A host CPU with ``n_gpus`` identical GPUs, each linked to the host, and all
    pairs of GPUs linked to each other when ``peer_link`` (GB/s, µs) is given."""
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


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))


def random_cpu(rng: np.random.Generator) -> Device:
    cores = int(rng.choice(CPU_CORES))
    sockets = int(rng.choice((1, 2, 4), p=(0.6, 0.35, 0.05))) if cores >= 16 else 1
    while cores % sockets:
        sockets //= 2
    return Device(id="cpu", kind="cpu", cores=cores, gflops=round(_log_uniform(rng, 15.0, 150.0), 1),
                  mem_bandwidth_gbs=round(_log_uniform(rng, 10.0, 60.0) * max(1.0, cores / 4) ** 0.6, 1),
                  memory_gb=float(rng.choice((16, 32, 64, 128, 256))), sockets=sockets,
                  smt=int(rng.choice((1, 2))), name=f"{cores}-core {sockets}-socket CPU")


def random_machine(seed: int) -> Machine:
    """Draw ``seed`` of the family (deterministic: the same seed, the same machine)."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise MachineError(f"random machine: the seed must be an int >= 0, got {seed!r}")
    rng = np.random.default_rng([int(seed), 0x0705])
    name = f"random-{int(seed)}"
    if rng.random() < 0.5:
        return Machine(name=name, devices=(random_cpu(rng),), description="a CPU-only machine of the family",
                       source=f"opsched.machine_family random:{seed}")
    host = random_cpu(rng)
    n_gpus = int(rng.integers(1, MAX_GPUS + 1))
    tflops = _log_uniform(rng, 4.0, 60.0)
    gpu = dict(cores=int(rng.choice((2, 4, 8))), gflops=round(tflops * 1000.0, 0),
               mem_bandwidth_gbs=round(_log_uniform(rng, 250.0, 2500.0), 0),
               memory_gb=float(rng.choice((8, 16, 24, 40, 80))), name=f"{tflops:.0f}-TFLOP/s GPU")
    host_link = (round(_log_uniform(rng, 6.0, 50.0), 1), round(float(rng.uniform(5.0, 15.0)), 1))
    peer = rng.random()
    peer_link = None if peer < 0.3 else (  # through the host, PCIe peer-to-peer, or NVLink-class
        (round(_log_uniform(rng, 6.0, 30.0), 1), round(float(rng.uniform(8.0, 20.0)), 1)) if peer < 0.65
        else (round(_log_uniform(rng, 40.0, 300.0), 1), round(float(rng.uniform(2.0, 6.0)), 1)))
    host_dict = {k: getattr(host, k) for k in ("cores", "gflops", "mem_bandwidth_gbs", "memory_gb", "sockets",
                                                "smt", "name")}
    return gpu_machine(name, n_gpus, gpu=gpu, host=host_dict, host_link=host_link, peer_link=peer_link,
                       description=f"{n_gpus} GPU(s) on a {host.cores}-core host, a machine of the family",
                       source=f"opsched.machine_family random:{seed}")


__all__ = ["CPU_CORES", "MAX_GPUS", "gpu_machine", "random_machine"]
