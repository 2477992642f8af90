"""The learned policy for real on this machine, against every heuristic and eager. See :mod:`opsched.benchmarks.apply_zoo`."""

from opsched.benchmarks.apply_zoo import main

if __name__ == "__main__":
    raise SystemExit(main())
