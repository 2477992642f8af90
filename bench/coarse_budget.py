"""A coarsened graph of at most 200 ops without GPUs: LP rounding instead of local search. See :mod:`opsched.benchmarks.coarse_budget`."""

from opsched.benchmarks.coarse_budget import main

if __name__ == "__main__":
    raise SystemExit(main())
