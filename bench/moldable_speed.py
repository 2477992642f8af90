"""CPA's allocation phase: biCPA's caps in one pass. See :mod:`opsched.benchmarks.moldable_speed`."""

from opsched.benchmarks.moldable_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
