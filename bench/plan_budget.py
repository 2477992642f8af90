"""Spending a small graph's spare planning time (the default search's ``fill``), chosen on validation.

See :mod:`opsched.benchmarks.plan_budget`.
"""

from opsched.benchmarks.plan_budget import main

if __name__ == "__main__":
    raise SystemExit(main())
