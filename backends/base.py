"""The base class of every backend: the :class:`~opsched.engine.contracts.Backend`
contract's bookkeeping (machine, context manager, close)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, TypeVar

from opsched.errors import ExecutionError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace

_B = TypeVar("_B", bound="BackendBase")


class BackendBase(ABC):
    """Executes a :class:`Plan` for an :class:`OpGraph` and returns a :class:`Trace`.

    A backend is bound to one :class:`Machine` (``self.machine``).  ``run``
    validates the plan against the graph and machine first, so a plan for
    another graph or machine fails with a clear :class:`~opsched.errors.PlanError`.
    Real backends are closed with ``close()`` (or used as context managers) so
    no worker thread or process outlives them.
    """

    name: str = "backend"
    #: True when run() measures real time (so results vary run to run).
    measured: bool = False

    def __init__(self, machine: Machine) -> None:
        self.machine = machine

    @abstractmethod
    def run(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any] | None = None) -> Trace:
        """Execute ``plan`` and return what happened."""

    def execute(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any]) -> Any:
        """Execute ``plan`` on ``inputs`` and return the model's outputs."""
        raise ExecutionError(f"backend {self.name!r} times plans but computes no outputs")

    def close(self) -> None:
        """Release threads, processes and devices (idempotent); nothing to do by default."""
        return None

    def __enter__(self: _B) -> _B:  # the backend itself, as its own type (OrtBackend.compile ...)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
