"""Sim-to-real: the planning model against measured makespans of fresh plans.

See :mod:`opsched.benchmarks.sim_to_real`.
"""

from opsched.benchmarks.sim_to_real import main

if __name__ == "__main__":
    raise SystemExit(main())
