"""``opsched graphs``: list the built-in graphs (written by the importer/zoo work)."""
from opsched.cli import app  # noqa: F401
