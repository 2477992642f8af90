"""Accuracy of the fitted performance model on measurements it was not fitted on.

See :mod:`opsched.benchmarks.perfmodel_accuracy`.
"""

from opsched.benchmarks.perfmodel_accuracy import main

if __name__ == "__main__":
    raise SystemExit(main())
