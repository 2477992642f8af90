"""A second OpenMP team and what it costs eager PyTorch in the same process. See :mod:`opsched.benchmarks.omp_teams`."""

from opsched.benchmarks.omp_teams import main

if __name__ == "__main__":
    raise SystemExit(main())
