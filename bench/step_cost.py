"""The default search at two or more prices of a local-search step, on the selection sets.

See :mod:`opsched.benchmarks.step_cost`.
"""

from opsched.benchmarks.step_cost import main

if __name__ == "__main__":
    raise SystemExit(main())
