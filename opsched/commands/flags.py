"""What the training commands share for their flags (``train-policy``, ``tune``).

Kept apart from the command modules so that both read it without importing
each other: the ``--hyperparams`` choices for ``--help``, read from
``agents/hyperparams/ppo.yml`` as text (no torch), and the command line as the
user typed it, which a run folder's ``command.txt`` records.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

#: Wall-clock minutes of the default ``opsched train-policy`` (seed 0) on the 2-core
#: development VM (README, "Status"); quoted by ``--help``.
DEFAULT_RUN_MINUTES = 12

#: ``opsched.agents.config.DEFAULT_TIMESTEPS`` (the RL phase's default steps), for
#: ``--help`` without importing torch; tests/test_train_cli.py keeps the two equal.
DEFAULT_TIMESTEPS = 40_000


def hyperparam_entries() -> dict[str, str]:
    """The entries of ``agents/hyperparams/ppo.yml``: name -> the first sentence of
    the comment above it, without its asides in parentheses.  Read as text (no
    torch, no import of ``opsched.agents``), so that ``--help`` stays fast."""
    spec = importlib.util.find_spec("opsched.agents")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / "hyperparams" / "ppo.yml"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    entries: dict[str, str] = {}
    comment: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            comment.append(line.lstrip("#").strip())
        elif not line.strip():
            comment = []
        else:
            m = re.match(r"^([A-Za-z_][\w-]*)\s*:\s*(#.*)?$", line)
            if m:
                about = re.split(r"(?<=\.)\s", " ".join(comment), maxsplit=1)[0].rstrip(".")
                while re.search(r"\([^()]*\)", about):
                    about = re.sub(r"\s*\([^()]*\)", "", about)
                entries[m.group(1)] = about
            comment = []
    return entries


def hyperparams_help(what: str) -> str:
    entries = hyperparam_entries()
    listed = "; ".join(f"{name} ({about})" if about else name for name, about in entries.items())
    return f"{what} Entries of agents/hyperparams/ppo.yml: {listed or 'see the file'}."


def typed_command(ctx: Any) -> list[str]:
    """The command line as the user typed it: ``opsched <command>`` and the
    options and arguments given on it (not those left at their defaults), in
    the command's order, each flag in its long spelling."""
    argv = ["opsched", *([ctx.info_name] if ctx.info_name else [])]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if source is None or source.name not in ("COMMANDLINE", "ENVIRONMENT", "PROMPT"):
            continue
        value = ctx.params.get(param.name)
        values = list(value) if param.multiple or (param.nargs != 1 and value is not None) else [value]
        if getattr(param, "param_type_name", "") != "option":
            argv += [str(v) for v in values]
            continue
        longest = sorted(param.opts, key=lambda o: (not o.startswith("--"), -len(o)))[0]
        if getattr(param, "is_flag", False):
            flag = longest
            if param.secondary_opts:  # --x/--no-x: the spelling that gives this value
                flag = longest if value else sorted(param.secondary_opts, key=lambda o: -len(o))[0]
            argv.append(flag)
            continue
        for v in values:
            argv += [longest, str(v)]
    return argv


def parse_bytes(text: str | None, flag: str = "--memory-limit") -> float | None:
    """``"2GB"``, ``"512MB"``, ``"1.5GiB"`` or a number of bytes -> bytes (None stays None)."""
    import re

    from opsched.errors import OpschedError

    if text is None or not str(text).strip():
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*", str(text))
    if not m:
        raise OpschedError(f"{flag} {text!r}: expected a size such as 2GB, 512MB or a number of bytes")
    unit = (m.group(2) or "b").lower().rstrip("b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    return float(m.group(1)) * scale
