"""The one interface the simulator and every real executor implement."""

from __future__ import annotations

from abc import ABC, abstractmethod

from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace


class Backend(ABC):
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
    def run(self, graph: OpGraph, plan: Plan) -> Trace:
        """Execute ``plan`` and return what happened."""

    def close(self) -> None:
        """Release threads, processes and devices (idempotent); nothing to do by default."""
        return None

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
