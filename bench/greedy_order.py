"""The greedy decoding's dispatch order: the episode's, the hint plan's, or the faster of the two.

See :mod:`opsched.benchmarks.greedy_order`.
"""

from opsched.benchmarks.greedy_order import main

if __name__ == "__main__":
    raise SystemExit(main())
