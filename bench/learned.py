"""The learned policy on the test split. See :mod:`opsched.benchmarks.learned`."""

from opsched.benchmarks.learned import main

if __name__ == "__main__":
    raise SystemExit(main())
