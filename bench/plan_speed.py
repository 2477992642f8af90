"""Planning speed of the exported learned scheduler, by graph size.

See :mod:`opsched.benchmarks.plan_speed`.
"""

from opsched.benchmarks.plan_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
