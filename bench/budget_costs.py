"""The planning budget's op-unit costs, measured. See :mod:`opsched.benchmarks.budget_costs`."""

from opsched.benchmarks.budget_costs import main

if __name__ == "__main__":
    raise SystemExit(main())
