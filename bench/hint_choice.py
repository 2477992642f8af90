"""Which plan the greedy decoding is hinted with (the best hint heuristic, by projected makespan, with CPA).

See :mod:`opsched.benchmarks.hint_choice`.
"""

from opsched.benchmarks.hint_choice import main

if __name__ == "__main__":
    raise SystemExit(main())
