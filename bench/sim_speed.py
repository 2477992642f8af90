"""Simulator speed: simulated ops per second on one core. See :mod:`opsched.benchmarks.sim_speed`."""

from opsched.benchmarks.sim_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
