"""The errors opsched raises on bad input.  Each message says what and where."""


class OpschedError(Exception):
    """Base class: everything opsched raises on purpose derives from it."""


class GraphError(OpschedError, ValueError):
    """An invalid graph: a cycle, a missing op, a duplicate id, a bad cost."""


class ModelImportError(OpschedError):
    """A model that cannot be imported (traced) into an OpGraph."""


class MachineError(OpschedError, ValueError):
    """An invalid machine description or an unknown preset."""


class PlanError(OpschedError, ValueError):
    """A plan that does not fit its graph or machine."""


class ExecutionError(OpschedError, RuntimeError):
    """An op raised during a real run; the message names the op."""


class PolicyError(OpschedError, ValueError):
    """A policy file that is missing, corrupt, or made for something else."""


class ConfigError(OpschedError):
    """A bad training / tuning setting (names the setting and the source)."""
