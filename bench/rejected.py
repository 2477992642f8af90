"""Plan-time search variants measured and not adopted. See :mod:`opsched.benchmarks.rejected`."""

from opsched.benchmarks.rejected import main

if __name__ == "__main__":
    raise SystemExit(main())
