"""Every opsched benchmark in one report (the same as ``opsched bench``).

See :mod:`opsched.benchmarks.run_all`.
"""

from opsched.benchmarks.run_all import main

if __name__ == "__main__":
    main()
