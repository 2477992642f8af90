"""Backends by name, imported lazily so the simulator never pulls in torch or TF."""

from __future__ import annotations

import importlib

from opsched.errors import OpschedError
from opsched.machine import Machine

#: name -> "module:Class".  Each class takes the machine as first argument.
BACKENDS: dict[str, str] = {
    "sim": "opsched.backends.sim:SimBackend",
    "torch-cpu": "opsched.backends.torch_cpu:TorchCPUBackend",
    "torch-cuda": "opsched.backends.torch_cuda:TorchCUDABackend",
    "tf": "opsched.backends.tf_cpu:TFBackend",
    "ort": "opsched.backends.ort_backend:OrtBackend",
}


def get_backend(name: str, machine: Machine, **kwargs: object):
    """Instantiate the backend called ``name`` for ``machine``."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise OpschedError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(machine, **kwargs)
