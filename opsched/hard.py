"""Hard families: machines and (graph, machine) pairs where list heuristics fall short of the best known plan.

The graphs live with the other generators (:mod:`opsched.synthetic`:
``fork_join``, ``mixed_scaling``, ``memory_bound``, ``dcgan``); the machines
here are machine specs ``hard:NAME:SEED`` (:func:`opsched.specs.load_machine`),
each seed a small perturbation of its figures (so training and test draw
different machines of one kind):

* ``hard:slow-links`` -- four V100-class GPUs whose peer links are slow (2 GB/s,
  through a host bridge, 30 us): with :func:`~opsched.synthetic.fork_join`,
  PISA's instances where HEFT places branches by their own finish time and
  then pays for moving heavy outputs to the join (Coleman and Krishnamachari
  found HEFT 3.6x off there);
* ``hard:hetero-gpus`` -- one fast GPU and three that are 4x slower, with
  NVLink-class peer links: spreading independent chains pays only on the
  right GPUs, and a heuristic that sees one device type (or one GPU) misses it;
* ``hard:manycore`` -- a 64-72 core CPU of slow cores: with
  :func:`~opsched.synthetic.mixed_scaling`, thread scaling that is
  non-monotone and differs op by op (small ops slow down past a few threads);
* ``hard:thin-memory`` -- 48 cores and little memory bandwidth: with
  :func:`~opsched.synthetic.memory_bound`, co-running ops slow each other
  (the analytic model's interference law);
* ``hard:busy`` -- a 32-core CPU with 8-16 cores busy with other work
  (``Device.busy_cores``): a team wider than the free cores waits for its
  slowest thread (:mod:`opsched.engine.sim`, "Busy cores").

Memory caps are not a family: the simulator reports memory in use but does
not enforce a device's capacity, so a plan cannot fail or slow down for
lack of memory there.

:data:`PAIRS` names the test pairs per family and :data:`TRAIN_PAIRS` a
share for training (other seeds, other machine draws);
:data:`SEED_MODELS` the seed papers' own networks as opsched builds them.
The gap of each family is measured by :mod:`opsched.benchmarks.hard`.
"""

from __future__ import annotations

import numpy as np

from opsched.errors import MachineError
from opsched.machine import Device, Link, Machine

#: name -> one-line description of each hard machine.
MACHINES: dict[str, str] = {
    "slow-links": "4 V100-class GPUs, 2 GB/s peer links through a host bridge",
    "hetero-gpus": "one fast GPU and three 4x slower ones, NVLink-class peer links",
    "manycore": "a 64-72 core CPU of slow cores (non-monotone thread scaling)",
    "thin-memory": "48 cores, little memory bandwidth (strong co-run interference)",
    "busy": "a 32-core CPU with 8-16 cores busy with other work",
}


def _jitter(rng: np.random.Generator, x: float, spread: float = 0.2) -> float:
    return round(float(x * rng.uniform(1.0 - spread, 1.0 + spread)), 2)


def _host(rng: np.random.Generator, cores: int = 32, gflops: float = 60.0, bw: float = 120.0,
          busy: float = 0.0) -> Device:
    return Device(id="cpu", kind="cpu", cores=cores, gflops=_jitter(rng, gflops), mem_bandwidth_gbs=_jitter(rng, bw),
                  memory_gb=256.0, sockets=2 if cores >= 32 else 1, busy_cores=busy,
                  name=f"{cores}-core host CPU")


def _gpu(i: int, rng: np.random.Generator, gflops: float, bw: float, name: str) -> Device:
    return Device(id=f"gpu:{i}", kind="gpu", cores=4, gflops=_jitter(rng, gflops, 0.1),
                  mem_bandwidth_gbs=_jitter(rng, bw, 0.1), memory_gb=16.0, name=name)


def hard_machine(name: str, seed: int = 0) -> Machine:
    """The hard machine ``name`` (see :data:`MACHINES`), perturbed by ``seed``."""
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    src = "opsched.hard (issue 23: instances hard for list heuristics)"
    if name == "slow-links":
        gpus = [_gpu(i, rng, 15700.0, 900.0, "V100-class GPU") for i in range(4)]
        host_bw, peer_bw = _jitter(rng, 12.0), _jitter(rng, 2.0)
        links = [Link("cpu", g.id, host_bw, 10.0) for g in gpus]
        links += [Link(a.id, b.id, peer_bw, 30.0) for k, a in enumerate(gpus) for b in gpus[k + 1:]]
        return Machine(f"hard-slow-links-{seed}", (_host(rng), *gpus), tuple(links), MACHINES[name], src)
    if name == "hetero-gpus":
        gpus = [_gpu(0, rng, 19500.0, 1550.0, "A100-class GPU")]
        gpus += [_gpu(i, rng, 4875.0, 390.0, "a 4x slower GPU") for i in range(1, 4)]
        links = [Link("cpu", g.id, _jitter(rng, 12.0), 10.0) for g in gpus]
        peer = _jitter(rng, 25.0)
        links += [Link(a.id, b.id, peer, 5.0) for k, a in enumerate(gpus) for b in gpus[k + 1:]]
        return Machine(f"hard-hetero-gpus-{seed}", (_host(rng), *gpus), tuple(links), MACHINES[name], src)
    if name == "manycore":
        cores = int(rng.choice((64, 68, 72)))
        cpu = _host(rng, cores=cores, gflops=30.0, bw=400.0)
        return Machine(f"hard-manycore-{seed}", (cpu,), (), MACHINES[name], src)
    if name == "thin-memory":
        cpu = _host(rng, cores=48, gflops=70.0, bw=25.0)
        return Machine(f"hard-thin-memory-{seed}", (cpu,), (), MACHINES[name], src)
    if name == "busy":
        cpu = _host(rng, cores=32, gflops=60.0, bw=120.0, busy=float(rng.integers(8, 17)))
        return Machine(f"hard-busy-{seed}", (cpu,), (), MACHINES[name], src)
    raise MachineError(f"unknown hard machine {name!r}; the hard machines are: {', '.join(MACHINES)}")


def load_hard_machine(spec: str) -> Machine:
    """``hard:NAME[:SEED]`` (a machine spec)."""
    _, _, rest = spec.partition(":")
    name, _, seed = rest.partition(":")
    try:
        s = int(seed) if seed else 0
    except ValueError:
        raise MachineError(f"machine spec {spec!r}: expected hard:NAME:SEED with an integer seed") from None
    return hard_machine(name, s)


#: The test pairs of each hard family: (graph spec, machine spec).
PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "fork-join/slow-links": (("fork_join:26:911", "hard:slow-links:911"), ("fork_join:42:912", "hard:slow-links:912"),
                             ("fork_join:34:913:width=6", "hard:slow-links:913")),
    "hetero-gpus": (("matmul_chains:40:914", "hard:hetero-gpus:914"), ("matmul_chains:60:915", "hard:hetero-gpus:915"),
                    ("layered:80:916", "hard:hetero-gpus:916")),
    "non-monotone scaling": (("mixed_scaling:80:917", "hard:manycore:917"),
                             ("mixed_scaling:150:918", "hard:manycore:918"),
                             ("mixed_scaling:60:919:decades=4.5", "knl-68")),
    "co-run interference": (("memory_bound:80:920", "hard:thin-memory:920"),
                            ("memory_bound:120:921:compute_share=0.5", "hard:thin-memory:921")),
    "busy cores": (("layered:100:922", "hard:busy:922"), ("erdos_renyi:80:923", "hard:busy:923"),
                   ("mixed_scaling:80:924", "hard:busy:924")),
}
#: The seed papers' own networks (test pairs): Liu et al. (IPDPS'19) trained ResNet-50, DCGAN,
#: Inception-v3 and an LSTM on a Xeon; Graphi (Tang et al.) ran its networks on a 68-core KNL (the zoo's
#: Inception-, ResNet-50-, LSTM- and NASNet-style graphs stand in for them); NN Maestro placed NAS-found
#: and classic CNNs (RandWire, NASNet, Inception, ResNet) on 2x2080Ti / 4xV100 / 4xA6000.
SEED_MODELS: dict[str, tuple[tuple[str, str], ...]] = {
    "Liu'19": (("zoo:resnet50@4x1.0", "xeon-8180-2s"), ("dcgan:14:925", "xeon-8180-2s"),
               ("zoo:inception@4x1.0", "xeon-8180-2s"), ("zoo:lstm@4x1.0", "xeon-8180-2s")),
    "Graphi": (("zoo:inception@4x1.0", "knl-68"), ("zoo:resnet50@4x1.0", "knl-68"), ("zoo:lstm@4x1.0", "knl-68"),
               ("zoo:nasnet@2x1.0", "knl-68")),
    "NN Maestro": (("zoo:randwire@4x1.0", "dgx1-4v100"), ("zoo:nasnet@2x1.0", "2x2080ti"),
                   ("zoo:inception@4x1.0", "4xa6000")),
}
#: A share of the hard families for training: other graph seeds, other machine draws.
TRAIN_PAIRS: tuple[tuple[str, str], ...] = (
    ("fork_join:26:11", "hard:slow-links:11"), ("fork_join:34:12:width=6", "hard:slow-links:12"),
    ("matmul_chains:40:13", "hard:hetero-gpus:13"), ("ffn:40:14", "hard:hetero-gpus:14"),
    ("mixed_scaling:80:15", "hard:manycore:15"), ("mixed_scaling:120:16", "hard:manycore:16"),
    ("memory_bound:80:17", "hard:thin-memory:17"), ("layered:100:18", "hard:busy:18"),
    ("mixed_scaling:60:19", "hard:busy:19"), ("dcgan:14:20", "random:20"),
)


def evaluation_pairs() -> list[tuple[str, str, str]]:
    """(family, graph spec, machine spec) of every hard test pair, the seed models last."""
    out = [(fam, g, m) for fam, pairs in PAIRS.items() for g, m in pairs]
    out += [(f"seed models: {paper}", g, m) for paper, pairs in SEED_MODELS.items() for g, m in pairs]
    return out


__all__ = ["MACHINES", "PAIRS", "SEED_MODELS", "TRAIN_PAIRS", "hard_machine", "load_hard_machine", "evaluation_pairs"]
