"""The exported scheduler's plan-time search (K samples, R refine steps), chosen on validation.

See :mod:`opsched.benchmarks.plan_search`.
"""

from opsched.benchmarks.plan_search import main

if __name__ == "__main__":
    raise SystemExit(main())
