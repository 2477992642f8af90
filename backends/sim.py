"""The simulator as a backend: :class:`SimBackend` replays a Plan in the engine's
discrete-event simulator (:class:`opsched.engine.sim.Simulator`) and returns its Trace."""

from __future__ import annotations

from opsched.backends.base import BackendBase
from opsched.engine.contracts import PerfModel
from opsched.engine.sim import Simulator
from opsched.machine import Machine


class SimBackend(Simulator, BackendBase):
    """The :class:`~opsched.engine.sim.Simulator` behind the Backend contract (``name`` "sim",
    not measured): what ``--backend sim`` runs.  Same arguments as the simulator."""

    name = "sim"
    measured = False

    def __init__(self, machine: Machine, model: PerfModel | None = None, noise: float = 0.0, seed: int = 0) -> None:
        BackendBase.__init__(self, machine)
        Simulator.__init__(self, machine, model, noise, seed)


__all__ = ["SimBackend"]
