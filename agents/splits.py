"""Honest splits: the graphs and machines a policy trains on, is selected on, and is reported on.

* **train**: what training sees - zoo models at small widths and some
  batches, three training steps (``train:`` specs: forward, backward and the
  optimizer's update as one graph), synthetic DAG families at seeds 1-3, the model-parallel placement
  families, on a randomized family of machines (``random:0`` ...
  ``random:47``, :mod:`opsched.machine_family`: 2 to 128 cores, sockets, SMT,
  0 to 7 GPUs with their links);
* **validation**: checkpoint selection only - other zoo models, synthetic
  seeds 101-107, on other draws of the family (``random:1000`` ...);
* **test**: reported only, never trained on or selected on - Keras
  applications imported through the TensorFlow importer, training steps of
  zoo models at unseen widths and batches and of a Keras application,
  synthetic seeds and sizes not trained on, zoo models at other widths and
  batches, placement
  graphs, on the presets (the 68-core KNL, the 2-socket Xeon, three multi-GPU
  servers) and this machine (``local``, planned with its profiled model).

Every set is a list of spec strings (:mod:`opsched.specs`); :func:`check`
proves they are disjoint.

The hard families (:mod:`opsched.hard`) come as (graph, machine) *pairs*,
since what makes them hard is the pairing (a fork-join on slow links, mixed
op sizes on a manycore CPU, a loaded machine): ``TEST_HARD_PAIRS`` (the hard
families and the seed papers' own networks) are reported only;
``TRAIN_HARD_PAIRS``, other seeds and other machine draws, are a share for
training.  :func:`check` covers their graphs and machines too.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Training steps (forward, loss, backward, the optimizer's update as one graph; ``train:`` specs,
#: :func:`opsched.specs.load_graph`) training sees: small widths, SGD and Adam.
TRAIN_STEP_GRAPHS: tuple[str, ...] = ("train:zoo:randwire@4x0.5", "train:zoo:lstm@4x0.5", "train:zoo:resnet50@2x0.5:adam")
#: Zoo models, synthetic graphs and training steps training sees (spec strings).
TRAIN_GRAPHS: tuple[str, ...] = (
    *TRAIN_STEP_GRAPHS,
    "zoo:resnet50@1x0.5", "zoo:resnet50@8x0.5",
    "zoo:nasnet@1x0.5", "zoo:nasnet@4x1.0",
    "zoo:randwire@1x0.5", "zoo:randwire@8x1.0",
    "zoo:lstm@1x0.5", "zoo:lstm@16x1.0",
    *[f"{fam}:{n}:{seed}" for fam in ("layered", "erdos_renyi", "watts_strogatz")
      for n in (20, 40, 60, 80, 100, 120) for seed in (1, 2, 3)],
    *[f"layered:{n}:4:mean_width={w}" for n in (40, 80, 120) for w in (1.5, 6)],
    *[f"{fam}:{n}:{seed}" for fam in ("matmul_chains", "ffn", "transformer") for n in (30, 60) for seed in (1, 2)],
)
#: Training machines: draws of the randomized family.
TRAIN_MACHINES: tuple[str, ...] = tuple(f"random:{s}" for s in range(48))

#: Checkpoint selection only.
VALIDATION_GRAPHS: tuple[str, ...] = (
    "zoo:inception@1x0.5", "zoo:transformer@4x0.5",
    "layered:80:101", "erdos_renyi:80:102", "watts_strogatz:80:103",
    "matmul_chains:40:104", "transformer:60:105",
)
VALIDATION_MACHINES: tuple[str, ...] = tuple(f"random:{s}" for s in range(1000, 1006))

#: Reported only.  Keras applications at 128 px (weights=None), imported through TensorFlow.
TEST_KERAS: tuple[str, ...] = tuple(f"keras:{name}:side=128" for name in (
    "MobileNetV2", "ResNet50", "DenseNet121", "InceptionV3", "EfficientNetB0", "NASNetMobile"))
#: Reported only: training steps of unseen zoo widths and batches, and a Keras application's step.
TEST_STEP_GRAPHS: tuple[str, ...] = ("train:zoo:inception@4x1.0", "train:zoo:nasnet@16x1.0",
                                     "train:zoo:transformer@4x1.0", "train:keras:MobileNetV2:side=128@4")
TEST_GRAPHS: tuple[str, ...] = (
    *TEST_KERAS,
    *TEST_STEP_GRAPHS,
    "zoo:inception@1x1.0", "zoo:resnet50@8x1.0", "zoo:nasnet@1x1.0", "zoo:randwire@1x1.0", "zoo:lstm@8x1.0",
    "zoo:transformer@1x1.0",
    "layered:200:901", "erdos_renyi:150:902", "watts_strogatz:60:903", "layered:30:904",
    "matmul_chains:60:905", "ffn:50:906", "transformer:90:907",
)
#: The CPU presets, the multi-GPU presets, and this machine.
TEST_CPU_MACHINES: tuple[str, ...] = ("knl-68", "xeon-8180-2s")
TEST_GPU_MACHINES: tuple[str, ...] = ("dgx1-4v100", "4xa6000", "2x2080ti")
TEST_MACHINES: tuple[str, ...] = (*TEST_CPU_MACHINES, *TEST_GPU_MACHINES, "local")
#: The model-parallel placement graphs of the test set (reported on the GPU machines).
TEST_PLACEMENT_GRAPHS: tuple[str, ...] = ("matmul_chains:60:905", "ffn:50:906", "transformer:90:907")


def _hard_pairs() -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    from opsched.hard import TRAIN_PAIRS, evaluation_pairs

    return TRAIN_PAIRS, tuple(dict.fromkeys((g, m) for _, g, m in evaluation_pairs()))


#: The hard families' (graph, machine) pairs: a share for training, and the test pairs.
TRAIN_HARD_PAIRS, TEST_HARD_PAIRS = _hard_pairs()


@dataclass(frozen=True)
class Split:
    """One split's graphs and machines (spec strings), and (graph, machine) pairs that go together."""

    name: str
    graphs: tuple[str, ...]
    machines: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...] = ()

    def all_of(self, what: str) -> set[str]:
        """Every graph (``what="graphs"``) or machine of the split, its pairs' included."""
        k = 0 if what == "graphs" else 1
        return set(getattr(self, what)) | {p[k] for p in self.pairs}


TRAIN = Split("train", TRAIN_GRAPHS, TRAIN_MACHINES, TRAIN_HARD_PAIRS)
VALIDATION = Split("validation", VALIDATION_GRAPHS, VALIDATION_MACHINES)
TEST = Split("test", TEST_GRAPHS, TEST_MACHINES, TEST_HARD_PAIRS)


def check(train: Split = TRAIN, validation: Split = VALIDATION, test: Split = TEST) -> None:
    """Raise ValueError if any graph or machine is in two splits (a graph spec at
    another size is another graph: ``zoo:inception@1x0.5`` vs ``@1x1.0``)."""
    for a, b in ((train, validation), (train, test), (validation, test)):
        for what in ("graphs", "machines"):
            both = a.all_of(what) & b.all_of(what)
            if both:
                raise ValueError(f"{what} {sorted(both)} are in both the {a.name} and the {b.name} split")


__all__ = ["TEST", "TEST_HARD_PAIRS", "TRAIN_HARD_PAIRS", "TEST_CPU_MACHINES", "TEST_GPU_MACHINES", "TEST_GRAPHS", "TEST_KERAS", "TEST_MACHINES",
           "TEST_PLACEMENT_GRAPHS", "TEST_STEP_GRAPHS", "TRAIN", "TRAIN_STEP_GRAPHS", "TRAIN_GRAPHS", "TRAIN_MACHINES", "VALIDATION", "VALIDATION_GRAPHS",
           "VALIDATION_MACHINES", "Split", "check"]
