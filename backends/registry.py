"""The one registry of backends: what each runs, what it needs, how it is planned and applied.

Every place that depends on a backend reads its :class:`BackendSpec` here
instead of branching on its name: the CLI's ``--backend`` choices and help,
the contract tests (parametrized over :data:`BACKENDS`), the planning model
(:func:`opsched.planning.planning_model`: which op profiles and which runtime
model plan for it), ``opsched profile`` and ``opsched.apply`` (the
per-framework adapter that schedules a network on it).  Classes are imported
lazily, so the simulator never pulls in torch or TensorFlow.

A new backend is its module plus one entry in :data:`BACKENDS`.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from opsched.engine.contracts import Backend
from opsched.errors import OpschedError
from opsched.machine import Machine

#: Op profile families: which profiler's measurements plan a backend.
TORCH_PROFILES, ORT_PROFILES = "torch", "ort"


@dataclass(frozen=True)
class BackendSpec:
    """One backend.

    ``target``: ``"module:Class"`` (the class takes the machine first).
    ``runs``: the graphs it executes -- ``"any"`` (the simulator: every
    OpGraph), or the importers whose graphs it runs (``torch``, ``keras``,
    ``onnx``).  ``adapters``: network framework -> ``"module:Class"`` of the
    :mod:`opsched.adapters` class that schedules such a network on it with
    ``opsched.apply`` (none: apply does not target it).  ``requires``: modules
    that must import.  ``cuda``: needs a CUDA GPU.  ``profiles``: whose op
    profiles plan it (``opsched profile --backend``), ``runtime_model``:
    ``"module:Class"`` of the :class:`~opsched.engine.contracts.RuntimeModel`
    that ``opsched profile`` fits for it (None: none)."""

    name: str
    target: str
    summary: str
    runs: tuple[str, ...]
    measured: bool = True
    requires: tuple[str, ...] = ()
    cuda: bool = False
    profiles: str | None = TORCH_PROFILES
    runtime_model: str | None = None
    adapters: tuple[tuple[str, str], ...] = ()

    @property
    def real(self) -> bool:
        """Executes ops for real (not the simulator)."""
        return self.measured

    def frameworks(self) -> tuple[str, ...]:
        """The network frameworks ``opsched.apply`` can schedule on this backend."""
        return tuple(f for f, _ in self.adapters)

    def adapter(self, framework: str) -> type:
        """The adapter class for a network of ``framework`` (OpschedError when there is none)."""
        for f, target in self.adapters:
            if f == framework:
                return _load(target)
        raise OpschedError(f"backend {self.name} does not schedule {framework} networks with opsched.apply; "
                           f"it takes {', '.join(self.frameworks()) or 'none'}")

    def runtime_model_class(self) -> type | None:
        return _load(self.runtime_model) if self.runtime_model else None

    def missing(self) -> str | None:
        """Why this backend cannot run here (a module that does not import), or None.
        A CUDA GPU is checked by the backend itself, which names what is missing."""
        for mod in self.requires:
            if importlib.util.find_spec(mod) is None:
                return f"backend {self.name} needs the Python package {mod!r}, which is not installed"
        return None


BACKENDS: dict[str, BackendSpec] = {s.name: s for s in (
    BackendSpec("sim", "opsched.backends.sim:SimBackend",
                "the simulator: a plan's makespan under the planning model (any machine, preset or probed)",
                runs=("any",), measured=False, profiles=None),
    BackendSpec("torch-cpu", "opsched.backends.torch_cpu:TorchCPUBackend",
                "PyTorch's CPU kernels on Graphi-style executor threads, per-op intra-op threads",
                runs=("torch",), requires=("torch",),
                runtime_model="opsched.engine.models.runtime:TorchCPURuntime",
                adapters=(("torch", "opsched.adapters.torch:TorchAdapter"),
                          ("torch-train", "opsched.adapters.train:TrainStepAdapter"))),
    BackendSpec("torch-cuda", "opsched.backends.torch_cuda:TorchCUDABackend",
                "PyTorch on CUDA GPUs (streams and events) and the CPU",
                runs=("torch",), requires=("torch",), cuda=True,
                adapters=(("torch", "opsched.adapters.torch:TorchAdapter"),
                          ("torch-train", "opsched.adapters.train:TrainStepAdapter"))),
    BackendSpec("tf", "opsched.backends.tf_cpu:TFBackend",
                "TensorFlow's graph runtime in worker processes: pool sizes, control dependencies, devices",
                runs=("keras",), requires=("tensorflow",),
                adapters=(("keras", "opsched.adapters.keras:KerasAdapter"),
                          ("keras-train", "opsched.adapters.keras_train:KerasTrainAdapter"))),
    BackendSpec("ort", "opsched.backends.ort_backend:OrtBackend",
                "ONNX Runtime's kernels: a plan lowered to co-running sessions on lanes",
                runs=("onnx",), requires=("onnx", "onnxruntime"), profiles=ORT_PROFILES,
                runtime_model="opsched.engine.models.ort_runtime:OrtRuntime",
                adapters=(("onnx", "opsched.adapters.onnx:OnnxAdapter"),
                          ("torch", "opsched.adapters.onnx:ExportedTorchAdapter"))),
)}


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def spec(name: str) -> BackendSpec:
    """The backend called ``name`` (OpschedError naming the choices otherwise)."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise OpschedError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}") from None


def get_backend(name: str, machine: Machine, **kwargs: Any) -> Backend:
    """Instantiate the backend called ``name`` for ``machine``."""
    s = spec(name)
    why = s.missing()
    if why is not None:
        raise OpschedError(why)
    return _load(s.target)(machine, **kwargs)


def names(*, real: bool | None = None, apply: bool = False) -> tuple[str, ...]:
    """Backend names: all, only real ones (``real=True``), or those ``opsched.apply`` targets (``apply``)."""
    return tuple(s.name for s in BACKENDS.values()
                 if (real is None or s.real == real) and (not apply or s.adapters))


def help_text(choices: tuple[str, ...] | None = None) -> str:
    """``name: summary`` for the CLI's ``--backend`` help."""
    return "; ".join(f"{n} ({BACKENDS[n].summary})" for n in (choices or tuple(BACKENDS)))


__all__ = ["BACKENDS", "ORT_PROFILES", "TORCH_PROFILES", "BackendSpec", "get_backend", "help_text", "names", "spec"]
