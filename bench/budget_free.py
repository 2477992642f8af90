"""biCPA as a free candidate of the default search on small graphs, against the search without it.

See :mod:`opsched.benchmarks.budget_free`.
"""

from opsched.benchmarks.budget_free import main

if __name__ == "__main__":
    raise SystemExit(main())
