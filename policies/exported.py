"""The exported learned policy: a folder of plain arrays and JSON, planned with numpy.

Why a separate format: training needs torch, stable-baselines3 and gymnasium,
but *using* a policy should not -- planning a graph before running it must be
light and fast, and loading a file someone handed you must never run code
from it.  So ``opsched export`` (:mod:`opsched.agents.export`) writes::

    policy/
        policy.json   format + version, architecture, observation layout (feature
                      names, normalisation, whether it reads node_levels),
                      action decoding, thread levels,
                      max nodes/edges, machines trained on, source run, and for
                      every array its shape and sha256
        weights.npz   the graph encoder's weights (float32, torch parameter names)

and :func:`load` reads it back with numpy only (``allow_pickle=False``; array
headers are checked against the declared shapes before any data is read).
Anything wrong -- a missing file, a truncated or corrupt archive, an unknown
format version, an array whose hash or shape does not match, a pickled
object, an edited ``policy.json`` -- raises
:class:`~opsched.errors.PolicyError` naming the file and the problem.

Integrity of ``policy.json`` itself: the array hashes protect the weights,
but sizes such as ``max_nodes``, ``max_edges`` or ``max_graph_ops`` change the
plans just as much, so :func:`write_policy` also records
``content_sha256``, the sha256 of the file's canonical content (every entry
but that one, as JSON with sorted keys and no whitespace, defaults a loader
fills in made explicit: a missing ``node_levels`` is 0, a missing
``machines.gpus`` true), and :func:`load` refuses a file whose content no
longer matches it.  Canonical, so re-indenting or reordering keys is no
edit; any change of a value is.  *Decision on older files*: the shipped
``policies/pretrained`` was re-exported with the field (same weights, every
other entry unchanged); a file written before the field existed (a user's
older export) still loads, but only when the entries the planner sizes itself
by agree with one another as every export before the field wrote them
(``action.n``/``action.wait`` from ``max_nodes``, ``max_edges = 4 x
max_nodes``, ``max_graph_ops = 32 x max_nodes``); its other entries are not
covered -- ``opsched export RUN`` again writes the field.

Planning (:meth:`ExportedPolicy.plan`) runs the environment's decision loop
without gymnasium: the simulator engine (:class:`~opsched.engine.sim.SimState`)
and the environment's own observation builder
(:mod:`opsched.engine.observe`) produce each state, the numpy encoder
(:mod:`opsched.policies.numpy_encoder`) scores the valid actions, the best one
is taken, and the decisions are recorded as a Plan exactly as
``ScheduleEnv`` records an episode (priority = dispatch order; an op started
after it became ready waits, via ``after``, for the op whose completion let it
start).  A graph larger than ``max_nodes`` is coarsened the same way too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opsched.engine.layout import (
    DYNAMIC_FEATURES,
    EDGES_PER_NODE,
    GLOBAL_FEATURES,
    HARDWARE_FEATURES,
    LEVEL_KEY,
    MAX_DEVICES,
    MAX_LEVELS,
    STATIC_FEATURES,
    ActionLayout,
)
from opsched.engine.observe import check_machine, prepare_episode
from opsched.errors import GraphError, MachineError, OpschedError, PolicyError
from opsched.graph import OpGraph
from opsched.io import atomic_write_bytes, atomic_write_text
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.policies.base import Policy, makespan_of
from opsched.policies.budget import BUDGET_OPS, FILL, planned_size, search_budget
from opsched.policies.numpy_encoder import NumpyEncoder, array_shapes, greedy

POLICY_FORMAT = "opsched.policy"
FORMAT_VERSION = 1
POLICY_FILE = "policy.json"
WEIGHTS_FILE = "weights.npz"
#: Graphs beyond max_nodes * this many ops are refused: coarsened that far, the
#: groups are too big for per-op decisions to mean much (override per export).
DEFAULT_MAX_COARSENING = 32
_MAX_JSON_BYTES = 4 << 20
_MAX_HIDDEN, _MAX_ROUNDS, _MAX_NODES = 4096, 64, 1 << 16
_DTYPES = ("<f4", "<f8")

THREAD_LEVELS_DOC = ("Device.thread_levels(): 1, 2, 4, ... below the device's cores, then all cores "
                     "(at most MAX_LEVELS); a GPU has one level, 1 stream slot")
NORMALIZATION_DOC = ("every column lies in [0, 1], computed by opsched.engine.observe as documented in "
                     "opsched.engine.layout: times divided by the graph's sequential makespan on all CPU cores "
                     "(the reference), log-scaled FLOPs/bytes/cores/GFLOPS/bandwidth, fractions of slots "
                     "and ops; padding slots and absent devices are 0")


LEVELS_DOC = (f"{LEVEL_KEY}: per op and CPU thread level k, log2(t(1) / t(k)) / 7 clipped to [-1, 1] from the "
              "performance model (opsched.engine.observe.level_features); 0 for padding and absent levels; "
              "its columns follow node_static and node_dynamic in the input layer")


#: The hint heuristics of every export written before ``policy.json`` recorded them.
LEGACY_HINTS: tuple[str, ...] = ("sequential", "tf-default", "tf-recommended", "critical-path-first", "heft",
                                 "maestro")
#: The observation entry that names the heuristics whose best plan is the policy's hint.
HINTS_KEY = "hint_heuristics"
#: The observation entry that says whether that plan fills the ``hint_*`` columns (absent: true,
#: as in every export written before it; false: a policy trained with ``hint_observation: false``).
HINT_PLAN_KEY = "hint_plan"
#: The observation entry that says whether the hint is also chosen from the heuristics the default
#: search adds for the graph (:func:`opsched.policies.budget.hint_extra`; absent: false, as in every
#: export written before it; new exports: true, as training's environment does).
HINT_BUDGET_KEY = "hint_budget"


def observation_spec(max_nodes: int, max_edges: int, levels: int = 0, hint_plan: bool = True) -> dict[str, Any]:
    """The observation layout a policy was trained on (checked at load time).

    ``levels``: columns of ``node_levels`` the policy reads (0: none; older
    exports lack the entry and read none).  ``hint_heuristics``: the registry's
    ``hint`` heuristics (:func:`opsched.policies.hints.hint_names`), whose best
    plan fills the ``hint_*`` columns: another set is another observation.
    ``hint_plan``: whether it does (false: the columns are 0, the policy stands on its own).
    ``hint_budget``: the hint is chosen from the heuristics the default search adds for the
    graph too (:func:`opsched.policies.hints.episode_heuristics`), as training's environment does."""
    from opsched.policies.hints import hint_names

    return {
        "max_nodes": int(max_nodes), "max_edges": int(max_edges), LEVEL_KEY: int(levels),
        HINTS_KEY: list(hint_names()), HINT_PLAN_KEY: bool(hint_plan), HINT_BUDGET_KEY: True,
        "max_devices": MAX_DEVICES, "max_levels": MAX_LEVELS,
        "static_features": list(STATIC_FEATURES), "dynamic_features": list(DYNAMIC_FEATURES),
        "hardware_features": list(HARDWARE_FEATURES), "global_features": list(GLOBAL_FEATURES),
        "normalization": NORMALIZATION_DOC,
        **({"levels": LEVELS_DOC} if levels else {}),
    }


def action_spec(max_nodes: int) -> dict[str, Any]:
    layout = ActionLayout(int(max_nodes))
    return {
        "n": layout.n, "wait": layout.wait,
        "encoding": "index = (slot * max_devices + device) * max_levels + level for a start; "
                    "index = max_nodes * max_devices * max_levels for wait",
        "slot": "the op's index in the (coarsened) graph", "device": "index into machine.devices",
        "level": "index into the device's thread levels",
        "choice": "argmax of the logits over the valid actions (the environment's action mask); "
                  "first one on ties",
    }


def array_digest(a: np.ndarray) -> str:
    """sha256 of an array's C-order bytes (its dtype and shape are checked separately)."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


#: The entry of policy.json that holds the sha256 of the rest (see the module docstring).
DIGEST_KEY = "content_sha256"


def meta_digest(meta: Mapping[str, Any]) -> str:
    """sha256 of ``policy.json``'s canonical content: every entry but
    :data:`DIGEST_KEY`, the loader's defaults made explicit, as JSON with sorted
    keys and no whitespace (so formatting is not content)."""
    body = {k: v for k, v in meta.items() if k != DIGEST_KEY}
    if isinstance(body.get("observation"), Mapping):
        body["observation"] = {LEVEL_KEY: 0, **body["observation"]}
    if isinstance(body.get("machines"), Mapping):
        body["machines"] = {"gpus": True, **body["machines"]}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# ------------------------------------------------------------------ writing
def write_policy(out_dir: str | Path, arrays: Mapping[str, np.ndarray], *, hidden: int, rounds: int,
                 max_nodes: int, max_edges: int | None = None, machines: list[str] | None = None,
                 gpus: bool = True, max_graph_ops: int | None = None,
                 source: Mapping[str, Any] | None = None, levels: int | None = None,
                 hint_plan: bool = True) -> Path:
    """Write ``out_dir/weights.npz`` and ``out_dir/policy.json`` (atomically,
    the JSON last: it names the arrays' hashes, so a crash in between leaves a
    folder that :func:`load` rejects, never a silently mixed one).

    ``arrays``: the GraphEncoder's ``state_dict`` as numpy (torch layout and
    names; see :func:`~opsched.policies.numpy_encoder.array_shapes`).
    ``gpus``: whether the policy was trained on machines with GPUs (if not, it
    refuses to place ops on one).  ``levels``: the ``node_levels`` columns
    the encoder reads (0 or ``MAX_LEVELS``; default: what the input layer's
    width says).  ``hint_plan``: the best hint heuristic's plan fills the
    ``hint_*`` columns (the run's ``hint_observation``).  Returns ``out_dir``."""
    out = Path(out_dir)
    max_edges = EDGES_PER_NODE * int(max_nodes) if max_edges is None else int(max_edges)
    if levels is None and "inp.weight" in arrays:
        levels = int(np.shape(arrays["inp.weight"])[1]) - len(STATIC_FEATURES) - len(DYNAMIC_FEATURES)
    levels = int(levels or 0)
    if levels not in (0, MAX_LEVELS):
        raise PolicyError(f"{out}: levels must be 0 or {MAX_LEVELS} (the node_levels columns), not {levels}")
    expected = array_shapes(hidden, rounds, levels)
    arrs = {k: np.ascontiguousarray(np.asarray(arrays[k], np.float32)) for k in expected if k in arrays}
    missing = sorted(set(expected) - set(arrs))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise PolicyError(f"{out}: the weights do not fit a graph encoder with hidden={hidden}, rounds={rounds} "
                          f"(missing {missing}, unexpected {extra})")
    for k, a in arrs.items():
        if a.shape != expected[k]:
            raise PolicyError(f"{out}: array {k!r} has shape {a.shape}, expected {expected[k]}")
        if not np.all(np.isfinite(a)):
            raise PolicyError(f"{out}: array {k!r} has non-finite values")
    import io

    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrs)
    meta = {
        "format": POLICY_FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": "graph-encoder",
        "architecture": {"hidden": int(hidden), "rounds": int(rounds)},
        "observation": observation_spec(max_nodes, max_edges, levels, hint_plan),
        "action": action_spec(max_nodes),
        "thread_levels": THREAD_LEVELS_DOC,
        "machines": {"trained_on": list(machines or []), "gpus": bool(gpus),
                     "max_graph_ops": int(max_graph_ops or DEFAULT_MAX_COARSENING * int(max_nodes))},
        "source": dict(source or {}),
        "arrays": {
            "file": WEIGHTS_FILE, "dtype": "<f4",
            "shapes": {k: list(a.shape) for k, a in arrs.items()},
            "sha256": {k: array_digest(a) for k, a in arrs.items()},
        },
    }
    meta[DIGEST_KEY] = meta_digest(meta)  # covers every entry above, sizes and limits included
    atomic_write_bytes(out / WEIGHTS_FILE, buf.getvalue())
    atomic_write_text(out / POLICY_FILE, json.dumps(meta, indent=1) + "\n")
    return out


# ------------------------------------------------------------------ loading
def pretrained_path() -> Path:
    """The folder of the policy shipped with opsched (``policies/pretrained``)."""
    return Path(__file__).resolve().parent / "pretrained"


def load(path: str | Path) -> ExportedPolicy:
    """Load an exported policy: a policy folder, its ``policy.json``, or a run
    folder holding ``policy/``.  Numpy only; nothing in the files is executed."""
    p = Path(path)
    if p.is_dir() and not (p / POLICY_FILE).exists() and (p / "policy" / POLICY_FILE).exists():
        p = p / "policy"
    meta_file = p / POLICY_FILE if p.is_dir() or p.suffix != ".json" else p
    if not meta_file.is_file():
        raise PolicyError(f"{meta_file}: no such file (an exported policy is a folder with {POLICY_FILE} "
                          f"and {WEIGHTS_FILE}; `opsched export runs/<run>` writes one)")
    meta = _read_meta(meta_file)
    weights = _weights_path(meta_file, meta)
    arrays = _read_arrays(weights, meta["arrays"])
    arch = meta["architecture"]
    try:
        encoder = NumpyEncoder(arrays, arch["hidden"], arch["rounds"], meta["observation"].get(LEVEL_KEY, 0))
    except ValueError as exc:  # cannot happen after the checks above; kept as a clear error
        raise PolicyError(f"{weights}: {exc}") from None
    return ExportedPolicy(meta_file.parent, meta, encoder)


def _fail(where: Path, problem: str) -> PolicyError:
    return PolicyError(f"{where}: {problem}")


def _check_hints(f: Path, hints: Any) -> None:
    """A policy's hint set must be distinct registered baseline heuristics.

    *Decision*: a policy plans with the hint set it was trained with (its
    ``hint_heuristics``, :attr:`ExportedPolicy.hints`), not with this
    opsched's current ``hint`` role, so adding a heuristic to that role (CPA
    joined it in issue 23) leaves every older export loadable and planning as
    it was trained.  Only a name this opsched cannot plan with is refused."""
    from opsched.policies.registry import BASELINE, names

    known = names(BASELINE)
    if (not isinstance(hints, list) or not hints or not all(isinstance(h, str) for h in hints)
            or len(set(hints)) != len(hints)):
        raise _fail(f, f"{HINTS_KEY} must be a non-empty list of distinct heuristic names, not {hints!r}")
    unknown = [h for h in hints if h not in known]
    if unknown:
        raise _fail(f, f"made with hint heuristics this opsched does not have: {unknown} (its observation's hint "
                       f"is the best plan of {hints}; this opsched's baseline heuristics are {list(known)}); "
                       "use the opsched it was made with, or retrain and export the policy with this one")


def _read_meta(f: Path) -> dict[str, Any]:
    try:
        size = f.stat().st_size
        if size > _MAX_JSON_BYTES:
            raise _fail(f, f"{size} bytes is far too large for a policy description (corrupt?)")
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f, f"cannot read the policy description ({exc})") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(f, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); the file is "
                       "truncated or corrupt - export the policy again") from None
    if not isinstance(meta, dict) or meta.get("format") != POLICY_FORMAT:
        raise _fail(f, f"not an opsched policy (missing \"format\": \"{POLICY_FORMAT}\")")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise _fail(f, f"unknown policy format version {version!r} (this opsched reads version {FORMAT_VERSION}); "
                       "export it again with this version of opsched")
    try:
        arch, obs, arrays = meta["architecture"], meta["observation"], meta["arrays"]
        hidden, rounds = arch["hidden"], arch["rounds"]
        ok_ints = all(type(v) is int for v in (hidden, rounds, obs["max_nodes"], obs["max_edges"]))
        shapes, digests, machines = arrays["shapes"], arrays["sha256"], meta["machines"]
        ok_types = (isinstance(shapes, dict) and isinstance(digests, dict) and isinstance(arrays["file"], str)
                    and isinstance(machines, dict) and type(machines.get("max_graph_ops")) is int)
    except (KeyError, TypeError) as exc:
        raise _fail(f, f"malformed policy description: missing or bad entry {exc}") from None
    if not (ok_ints and ok_types):
        raise _fail(f, "malformed policy description: architecture, observation sizes, arrays or machines "
                       "have the wrong types")
    levels = obs.get(LEVEL_KEY, 0)
    if levels not in (0, MAX_LEVELS) or type(levels) is not int:
        raise _fail(f, f"{LEVEL_KEY} must be 0 or {MAX_LEVELS} (the columns the policy reads), not {levels!r}")
    if not (1 <= hidden <= _MAX_HIDDEN and 0 <= rounds <= _MAX_ROUNDS and 1 <= obs["max_nodes"] <= _MAX_NODES
            and 1 <= obs["max_edges"] <= EDGES_PER_NODE * _MAX_NODES and machines["max_graph_ops"] >= 1):
        raise _fail(f, f"architecture or sizes out of range (hidden={hidden}, rounds={rounds}, "
                       f"max_nodes={obs['max_nodes']}, max_edges={obs['max_edges']})")
    if meta.get("kind") != "graph-encoder":
        raise _fail(f, f"unknown policy kind {meta.get('kind')!r} (this opsched plans with 'graph-encoder')")
    mine = observation_spec(obs["max_nodes"], obs["max_edges"])
    for key in ("max_devices", "max_levels", "static_features", "dynamic_features", "hardware_features",
                "global_features"):
        if obs.get(key) != mine[key]:
            raise _fail(f, f"made for another observation layout: its {key} are {obs.get(key)!r}, this opsched's "
                           f"environment has {mine[key]!r}; retrain or use a matching opsched")
    _check_hints(f, obs.get(HINTS_KEY, list(LEGACY_HINTS)))
    if type(obs.get(HINT_PLAN_KEY, True)) is not bool:
        raise _fail(f, f"{HINT_PLAN_KEY} must be true or false, not {obs[HINT_PLAN_KEY]!r}")
    if type(obs.get(HINT_BUDGET_KEY, False)) is not bool:
        raise _fail(f, f"{HINT_BUDGET_KEY} must be true or false, not {obs[HINT_BUDGET_KEY]!r}")
    expected = {k: list(v) for k, v in array_shapes(hidden, rounds, levels).items()}
    if shapes != expected:
        diff = sorted(set(shapes) ^ set(expected)) or sorted(k for k in shapes if shapes[k] != expected[k])
        raise _fail(f, f"declared array shapes do not fit a graph encoder with hidden={hidden}, rounds={rounds} "
                       f"(first differences: {diff[:4]})")
    if set(digests) != set(expected) or not all(isinstance(v, str) and len(v) == 64 for v in digests.values()):
        raise _fail(f, "the sha256 list must give one 64-hex-digit hash per array")
    if arrays.get("dtype") not in _DTYPES:
        raise _fail(f, f"array dtype {arrays.get('dtype')!r} is not one of {_DTYPES}")
    name = arrays["file"]
    if not name or Path(name).name != name or name in (".", ".."):
        raise _fail(f, f"the weights file must be a plain file name next to it, not {name!r}")
    # Last, so that the checks above still say which entry is wrong where they can tell.
    digest = meta.get(DIGEST_KEY)
    if digest is None:  # written before policy.json carried its digest: cross-check what sizes the planner
        layout = ActionLayout(obs["max_nodes"])
        action = meta.get("action")
        wrong = []
        if not isinstance(action, dict) or (action.get("n"), action.get("wait")) != (layout.n, layout.wait):
            wrong.append(f"action.n/action.wait (must be {layout.n}/{layout.wait} for "
                         f"max_nodes={obs['max_nodes']})")
        if obs["max_edges"] != EDGES_PER_NODE * obs["max_nodes"]:
            wrong.append(f"max_edges={obs['max_edges']} (an export without {DIGEST_KEY} has "
                         f"{EDGES_PER_NODE} x max_nodes = {EDGES_PER_NODE * obs['max_nodes']})")
        if machines["max_graph_ops"] != DEFAULT_MAX_COARSENING * obs["max_nodes"]:
            wrong.append(f"machines.max_graph_ops={machines['max_graph_ops']} (an export without {DIGEST_KEY} "
                         f"has {DEFAULT_MAX_COARSENING} x max_nodes = {DEFAULT_MAX_COARSENING * obs['max_nodes']})")
        if wrong:
            raise _fail(f, f"has no {DIGEST_KEY} (written by an older opsched, or the entry was removed) and its "
                           f"sizes disagree: {'; '.join(wrong)}; it was edited - export the policy again "
                           "(opsched export RUN)")
    elif not isinstance(digest, str) or digest != meta_digest(meta):
        raise _fail(f, f"the content does not match its {DIGEST_KEY}: an entry was changed after the policy was "
                       "written (every entry is covered, sizes and limits included) or the file is corrupt; "
                       "export the policy again (opsched export RUN)")
    return meta


def _weights_path(meta_file: Path, meta: dict[str, Any]) -> Path:
    name = meta["arrays"]["file"]
    if not name or Path(name).name != name or name in (".", ".."):
        raise _fail(meta_file, f"the weights file must be a plain file name next to it, not {name!r}")
    w = meta_file.parent / name
    if not w.is_file():
        raise _fail(w, "no such file (the policy's weights are missing)")
    return w


def _read_arrays(w: Path, spec: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Read the npz with ``allow_pickle=False`` after checking every member's
    header (dtype, shape) against the declaration -- so a hostile header can
    neither smuggle a pickle nor make us allocate gigabytes -- then check each
    array's sha256 and finiteness."""
    shapes, digests, dtype = spec["shapes"], spec["sha256"], np.dtype(spec["dtype"])
    try:
        with zipfile.ZipFile(w) as zf:
            members = zf.namelist()
            wanted = {f"{k}.npy" for k in shapes}
            if sorted(members) != sorted(wanted):
                extra = sorted(set(members) - wanted)
                lost = sorted(k[:-4] for k in wanted - set(members))
                raise _fail(w, f"the archive's members do not match the declared arrays (missing {lost[:4]}, "
                               f"unexpected {extra[:4]})")
            for k in shapes:
                with zf.open(f"{k}.npy") as fh:
                    version = np.lib.format.read_magic(fh)
                    if version == (1, 0):
                        shape, _, dt = np.lib.format.read_array_header_1_0(fh)
                    elif version == (2, 0):
                        shape, _, dt = np.lib.format.read_array_header_2_0(fh)
                    else:
                        raise _fail(w, f"array {k!r}: unsupported .npy version {version}")
                if dt.hasobject:
                    raise _fail(w, f"array {k!r} holds pickled Python objects ({dt}); refused")
                if dt != dtype or list(shape) != list(shapes[k]):
                    raise _fail(w, f"array {k!r} is {dt} {tuple(shape)}, declared {dtype} {tuple(shapes[k])}")
    except PolicyError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, KeyError) as exc:
        raise _fail(w, f"truncated or corrupt weights archive ({type(exc).__name__}: {exc})") from None
    out: dict[str, np.ndarray] = {}
    try:
        with np.load(w, allow_pickle=False) as npz:
            for k in shapes:
                out[k] = npz[k]
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError) as exc:
        raise _fail(w, f"truncated or corrupt weights archive ({type(exc).__name__}: {exc})") from None
    for k, a in out.items():
        if array_digest(a) != digests[k]:
            raise _fail(w, f"array {k!r} does not match its sha256 in {POLICY_FILE} (modified or corrupt)")
        if not np.all(np.isfinite(a)):
            raise _fail(w, f"array {k!r} has non-finite values")
    return out


# ------------------------------------------------------------- the policy
_BLAS: Any = None


def _one_blas_thread() -> Any:
    """A context that keeps numpy's BLAS on one thread while planning.

    Planning multiplies matrices of a few hundred rows, thousands of times:
    BLAS threads only add synchronisation, and on a busy machine each product
    waits for a descheduled helper (10x slower, measured).  Uses threadpoolctl
    when it is installed (it is with scikit-learn); without it, BLAS is left
    alone.  The limit is process-wide while it lasts."""
    global _BLAS
    try:
        if _BLAS is None:
            from threadpoolctl import ThreadpoolController

            _BLAS = ThreadpoolController()
        return _BLAS.limit(limits=1, user_api="blas")
    except Exception:  # not installed, or an unusual BLAS: plan with its defaults
        return contextlib.nullcontext()


@contextlib.contextmanager
def _gc_paused() -> Any:
    """Python's cyclic garbage collector off while planning: a plan allocates
    tens of thousands of short-lived objects (simulator events, assignments)
    and no cycles worth collecting, and the collector's passes cost 3% of a
    200-op plan (measured); it is switched back on after (if it was on)."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class ExportedPolicy(Policy):
    """A learned policy loaded from an export folder; plans with numpy only."""

    name = "learned"

    def __init__(self, folder: Path, meta: dict[str, Any], encoder: NumpyEncoder) -> None:
        self.folder = Path(folder)
        self.meta = meta
        self.encoder = encoder
        self.max_nodes = int(meta["observation"]["max_nodes"])
        self.max_edges = int(meta["observation"]["max_edges"])
        self.max_graph_ops = int(meta["machines"]["max_graph_ops"])
        self.gpus = bool(meta["machines"].get("gpus", True))
        self.layout = ActionLayout(self.max_nodes)
        #: The heuristics whose best plan is this policy's hint: those it was trained with (each a registered
        #: baseline, checked at load), which may differ from this opsched's current ``hint`` role.
        self.hints: tuple[str, ...] = tuple(meta["observation"].get(HINTS_KEY, LEGACY_HINTS))
        #: Whether their best plan fills the observation's ``hint_*`` columns (else they are 0).
        self.hint_plan = bool(meta["observation"].get(HINT_PLAN_KEY, True))
        #: Whether the hint is chosen from the default search's extra heuristics too
        #: (:func:`opsched.policies.hints.episode_heuristics`; exports before it: no).
        self.hint_budget = bool(meta["observation"].get(HINT_BUDGET_KEY, False))
        #: Identifies this policy's decisions (for plan caches): its whole description,
        #: which holds the arrays' hashes, its sizes and limits.
        self.digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        src = self.meta.get("source", {}).get("run", "?")
        return f"<policy learned from {src} ({self.folder})>"

    def check(self, graph: OpGraph, machine: Machine) -> None:
        """Raise :class:`PolicyError` if this policy cannot plan ``graph`` on ``machine``."""
        where = f"policy {self.folder}"
        n = len(graph.ops)
        if n > self.max_graph_ops:
            raise PolicyError(f"{where}: graph {graph.name!r} has {n} ops; this policy plans at most "
                              f"{self.max_graph_ops} (max_nodes={self.max_nodes} after coarsening)")
        try:
            check_machine(machine)
        except MachineError as exc:
            raise PolicyError(f"{where}: cannot plan for this machine: {exc}") from None
        if machine.gpus and not self.gpus:
            raise PolicyError(f"{where}: trained on CPU-only machines ({', '.join(self.meta['machines']['trained_on'])}); "
                              f"machine {machine.name!r} has {len(machine.gpus)} GPU(s)")

    def planning(self) -> dict[str, Any]:
        """The plan-time search this policy runs by default (:data:`DEFAULT_PLANNING`,
        overridden by the export's ``planning`` entry)."""
        candidates = list(dict.fromkeys([*self.hints, *EXTRA_CANDIDATES]))
        return {**DEFAULT_PLANNING, "candidates": candidates, **self.meta.get("planning", {})}

    def plan(self, graph: OpGraph, machine: Machine, model: Any = None, *, samples: int | None = None,
             candidates: Sequence[str] | None = None, temperature: float | None = None,
             refine: int | None = None, seed: int = 0, prior_scale: float | None = None,
             fill: float | None = None, large_baselines: bool | None = None) -> Plan:
        """Schedule ``graph`` on ``machine`` and return a Plan for the original graph.

        The learned policy decodes the episode greedily and ``samples`` more
        times by sampling its choices (Gumbel, at ``temperature``); every
        heuristic named in ``candidates`` plans it too; each candidate is
        simulated with ``model`` (the planning model; default the analytic
        one); the fastest is then improved by ``refine`` steps of local search
        in the simulator (:mod:`opsched.policies.refine`; a graph smaller than
        the budget graph spends a share ``fill`` of its spare planning time on
        more steps, and LP rounding joins the default candidates where it fits,
        and, with ``large_baselines``, biCPA and LP rounding on a graph larger
        than the budget graph or coarsened, on a machine without GPUs:
        :func:`opsched.policies.budget.search_budget`) and the fastest plan
        found is returned - its origin in ``plan.meta["chosen"]``, every
        candidate's makespan in ``plan.meta["candidates"]``, the heuristic
        whose plan hinted the policy in ``plan.meta["hint"]``.  Seeded by
        ``seed``: the same call, the same plan.  So the result is never
        slower than the best candidate heuristic under the model it was
        planned with.  ``samples=0, candidates=(), refine=0`` is the policy
        alone (greedy decoding).  Defaults: :meth:`planning`.  Every candidate
        with its predicted makespan: :meth:`plan_candidates`."""
        with _gc_paused():
            found = self.plan_candidates(graph, machine, model, samples=samples, candidates=candidates,
                                         temperature=temperature, refine=refine, seed=seed, prior_scale=prior_scale,
                                         fill=fill, large_baselines=large_baselines)
        return pick(found)

    def plan_candidates(self, graph: OpGraph, machine: Machine, model: Any = None, *,
                        samples: int | None = None, candidates: Sequence[str] | None = None,
                        temperature: float | None = None, refine: int | None = None,
                        seed: int = 0, prior_scale: float | None = None,
                        fill: float | None = None, large_baselines: bool | None = None) -> dict[str, tuple[Plan, float]]:
        """Every plan :meth:`plan` chose from, by origin (``greedy``, ``sample-K``,
        ``heuristic:NAME``, ``refined(...)``), with its makespan under ``model``
        (NaN for the lone greedy plan when nothing else is asked for).
        ``opsched.apply`` times the fastest few on the real runtime
        (:func:`opsched.measured.choose_measured`)."""
        cfg = self.planning()
        samples = int(cfg["samples"] if samples is None else samples)
        names = tuple(cfg["candidates"] if candidates is None else candidates)
        temperature = float(cfg["temperature"] if temperature is None else temperature)
        refine = int(cfg["refine"] if refine is None else refine)
        scale = float(cfg["prior_scale"] if prior_scale is None else prior_scale)
        fill = float(cfg["fill"] if fill is None else fill)
        large_baselines = cfg["large_baselines"] if large_baselines is None else large_baselines
        if not isinstance(large_baselines, (bool, np.bool_)):
            raise PolicyError(f"policy {self.folder}: large_baselines must be true or false, got {large_baselines!r}")
        if samples < 0 or refine < 0 or not temperature > 0 or not (math.isfinite(scale) and scale >= 0) \
                or not 0.0 <= fill <= 1.0:
            raise PolicyError(f"policy {self.folder}: samples and refine must be >= 0, temperature > 0, "
                              f"prior_scale a finite number >= 0 and fill in [0, 1], got {samples}, {refine}, "
                              f"{temperature}, {scale}, {fill}")
        self.check(graph, machine)
        budget_ops = int(cfg["budget_ops"])
        size = planned_size(len(graph.ops), self.max_nodes, budget_ops)
        budget = search_budget(size, bool(machine.gpus), refine, fill, budget_ops, large_baselines,
                               len(graph.ops) > self.max_nodes)
        refine = budget.steps
        added: tuple[str, ...] = ()  # candidates only the spare budget brought
        if candidates is None:  # the spare budget adds candidates to the default list only, never to a named one
            added = tuple(x for x in budget.extra if x not in names)
            names = (*names, *added)
        from opsched.engine.sim import Simulator
        from opsched.policies.hints import attach_slot_hint, episode_heuristics
        from opsched.policies.registry import entry

        # the hint's plans, and the default candidates' (the budget's extras among them where they are hints)
        heuristics = episode_heuristics(graph, machine, model, self.hints, self.max_nodes,
                                        self.hint_plan and self.hint_budget)
        try:
            data = prepare_episode(graph, machine, model, self.max_nodes, self.max_edges)
        except (GraphError, MachineError) as exc:
            raise PolicyError(f"policy {self.folder}: cannot plan graph {graph.name!r}: {exc}") from None
        if self.hint_plan:  # else the hint_* columns are 0, as in training
            attach_slot_hint(data, heuristics, model)
        with _one_blas_thread():
            plans = {"greedy": decode(self, data, prior_scale=scale)}
            for k in range(samples):
                plans[f"sample-{k}"] = decode(self, data, np.random.default_rng([seed, k]), temperature, scale)
        if len(plans) == 1 and not names and not refine:
            return {"greedy": (plans["greedy"], float("nan"))}
        sim = Simulator(machine, model)
        spans = {k: sim.makespan(graph, p) for k, p in plans.items()}
        for name in names:
            if name in heuristics:
                plan, span = heuristics[name]
            else:
                try:
                    plan = entry(name).make().plan(graph, machine, model)
                except OpschedError:
                    if name not in added:
                        raise
                    continue  # a candidate only the spare budget added: planning goes on without it
                span = makespan_of(sim, graph, plan)
            plans[f"heuristic:{name}"], spans[f"heuristic:{name}"] = plan, span
        chosen = min(spans, key=spans.__getitem__)
        if refine:
            key = f"refined({chosen})"
            for found in _refine(data, plans[chosen], chosen, refine, np.random.default_rng([seed, 0x5EA])):
                span = sim.makespan(graph, found)
                if span < min(spans[chosen], spans.get(key, math.inf)) * (1.0 - 1e-9):
                    plans[key], spans[key] = found, span
        meta = {"candidates": spans, "policy_dir": str(self.folder), "refine_steps": refine,
                "hint": plans["greedy"].meta["hint"]}  # decode names it
        return {k: (Plan(p.assignments, p.graph_fingerprint, p.machine_fingerprint, self.name,
                         {**p.meta, **meta, "chosen": k}), spans[k]) for k, p in plans.items()}


def pick(candidates: Mapping[str, tuple[Plan, float]]) -> Plan:
    """The candidate plan with the smallest predicted makespan (the first on ties
    and NaN: a lone greedy plan)."""
    return min(candidates.values(), key=lambda c: (not math.isfinite(c[1]), c[1]))[0]


#: Random moves a refine step may draw until one changes the plan (see :func:`opsched.policies.refine.local_search`).
REFINE_DRAWS = 8


def _refine(data: Any, plan: Plan, source: str, budget: int, rng: np.random.Generator) -> list[Plan]:
    """``plan`` improved by ``budget`` local-search steps on the episode's slots, as
    Plans for the original graph to simulate there (none when search found
    nothing better on the slots).

    Two expansions of what search found: one where the slots search left as
    they were keep ``plan``'s own assignments member by member
    (:class:`opsched.engine.slots.Follow`), and, where that differs, the plain
    one, slot by slot on the level grid, which is what search itself replayed.
    Neither always wins: following keeps a moldable plan's per-op thread counts
    on a coarsened graph (the test split's layered:200 on xeon-8180-2s, 1.29x
    -> 1.00x the best heuristic), while search's moves were chosen for the
    grid (layered:30 on the same machine, TensorFlow's settings at 28 of 56
    threads: 0.855x on the grid, 1.057x followed)."""
    from opsched.engine.slots import follow_of, makespan, to_plan
    from opsched.policies.refine import local_search

    follow = follow_of(data, plan, source)
    start = follow.slots.copy()
    if not np.isfinite(makespan(data, start)):
        return []
    found = local_search(data, start, budget, rng, draws=REFINE_DRAWS)
    if not found.makespan < start.makespan:
        return []
    followed, plain = to_plan(data, found, plan.policy, follow=follow), to_plan(data, found, plan.policy)
    return [followed] if followed.assignments == plain.assignments else [followed, plain]


#: The plan-time search of an exported policy: greedy decoding plus ``samples``
#: sampled decodings at ``temperature``, and the plans of the ``candidates``
#: heuristics; the fastest under the planning model, improved by ``refine``
#: local-search steps, wins.
#: Chosen on the validation split within the planning budget (a 200-op graph in at
#: most 100 ms on one core, the heuristics included; issue 23): the best-quality
#: setting that fits (``python -m opsched.benchmarks.plan_search``, docs/learning.md;
#: quiet VM).  The sampled decoding added nothing and cost a third of the time;
#: CPA as an extra candidate gains more than any refine budget: hint heuristics
#: only, R = 20: 0.9973x the best hint heuristic, 95 ms; R = 40: 0.9958x, 110 ms;
#: with CPA, R = 0: 0.9787x, 89 ms; R = 10: 0.9751x, 99 ms (the default); R = 20:
#: 0.9738x, 112 ms.
#: ``prior_scale`` multiplies the learned hint prior's logit bonuses at plan time
#: (1: the network as trained): chosen on validation, where the greedy decoding
#: improved monotonically up to x10 (the shipped policy 1.0015 -> 1.0009x the
#: best heuristic, an imitation-of-the-best-known-plan policy 1.049 -> 1.001x); on
#: the test split the greedy decoding then gives 1.061 -> 1.017x and 1.105 -> 1.017x
#: (``python -m opsched.benchmarks.plan_search``, docs/learning.md).  The network
#: still overrides the hint where its own logits differ by more than the bonus.
#: ``budget_ops`` and ``fill``: a graph smaller than ``budget_ops`` ops spends its spare
#: planning time (:mod:`opsched.policies.budget`): LP rounding as a candidate where it
#: fits, then ``fill`` of the rest on more local-search steps; chosen on validation
#: (``python -m opsched.benchmarks.plan_budget``, docs/learning.md).  ``large_baselines``: a
#: graph larger than that (a training step) on a machine without GPUs gets biCPA and LP
#: rounding as candidates too, whatever they cost, so every baseline heuristic is one (the
#: same benchmark, its 20 large-graph pairs without GPUs: 1.029 -> 0.999x the best
#: heuristic, median planning 146 -> 320 ms; :mod:`opsched.policies.budget`), and so does a
#: coarsened graph of at most ``budget_ops`` ops, instead of its local search.
DEFAULT_PLANNING: dict[str, Any] = {
    "samples": 0, "temperature": 1.0, "refine": 10, "prior_scale": 10.0, "budget_ops": BUDGET_OPS, "fill": FILL,
    "large_baselines": True,
}  # the candidates default to the policy's hint heuristics (ExportedPolicy.hints) plus EXTRA_CANDIDATES
#: Candidates beyond the hint heuristics: CPA (Radulescu & van Gemund), the
#: moldable-task baseline, 2.2% better plans on validation for ~11 ms.  A hint
#: heuristic itself since issue 23 (the shipped policy's hints hold it); kept
#: for exports made before, whose hint sets lack it.
EXTRA_CANDIDATES: tuple[str, ...] = ("cpa",)


def decode_episode(encoder: NumpyEncoder, data: Any, rng: np.random.Generator | None = None,
                   temperature: float = 1.0, prior_scale: float = 1.0) -> tuple[Any, int, int]:
    """One episode of the engine's decision loop decided by ``encoder``: the
    best-scored valid action at every decision (greedy), or one drawn from the
    softmax of the scores at ``temperature`` (``rng`` given: Gumbel-max).
    Returns the finished :class:`~opsched.engine.episode.Episode`, the
    decisions taken and how many were forced."""
    from opsched.engine.episode import run_episode

    enc = encoder.episode(data.node_static, data.edge_index, data.edge_mask, data.node_mask,
                          data.node_levels if encoder.levels else None, prior_scale)
    if rng is None:
        def choose(ep: Any, ops: np.ndarray, cols: np.ndarray, can_wait: bool) -> int:
            dyn, hw, glob = ep.obs.state()
            return greedy(enc.grid_scores(dyn, hw, glob, ops, cols, can_wait))
    else:
        def choose(ep: Any, ops: np.ndarray, cols: np.ndarray, can_wait: bool) -> int:
            dyn, hw, glob = ep.obs.state()
            scores = enc.grid_scores(dyn, hw, glob, ops, cols, can_wait).astype(np.float64)
            return int(np.argmax(scores / temperature + rng.gumbel(size=scores.shape)))

    return run_episode(data, choose)


def decode(policy: ExportedPolicy, data: Any, rng: np.random.Generator | None = None,
           temperature: float = 1.0, prior_scale: float | None = None) -> Plan:
    """:func:`decode_episode` with ``policy``'s encoder, as a Plan for the original
    graph; ``prior_scale`` defaults to the policy's planning setting."""
    scale = float(policy.planning()["prior_scale"] if prior_scale is None else prior_scale)
    ep, decisions, forced = decode_episode(policy.encoder, data, rng, temperature, scale)
    now = ep.now
    src = policy.meta.get("source", {})
    from opsched.engine.slots import episode_plan

    return episode_plan(data, ep, policy.name, {
        "policy_dir": str(policy.folder), "source_run": src.get("run"), "slots": data.n,
        "decisions": decisions, "forced": forced, "sim_makespan": float(now) if math.isfinite(now) else None,
        "hint": None if data.hint_follow is None else data.hint_follow.plan.policy})


__all__ = ["pick", "DEFAULT_PLANNING", "ExportedPolicy", "FORMAT_VERSION", "decode", "decode_episode", "POLICY_FORMAT", "action_spec", "array_digest", "load",
           "observation_spec", "pretrained_path", "write_policy"]
