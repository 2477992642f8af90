"""Hard families and the honest ceiling. See :mod:`opsched.benchmarks.hard`."""

from opsched.benchmarks.hard import main

if __name__ == "__main__":
    raise SystemExit(main())
