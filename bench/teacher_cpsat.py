"""The training teacher's CP-SAT stage: plan quality gained and seconds per pair.

See :mod:`opsched.benchmarks.teacher_cpsat`.
"""

from opsched.benchmarks.teacher_cpsat import main

if __name__ == "__main__":
    raise SystemExit(main())
