"""SB3 callbacks of a training run: validation evaluation, checkpoints, Ctrl-C, progress.

Evaluations and checkpoints fire at the *start* of a rollout, when the
parameters reflect every step counted so far (SB3 updates them between
rollouts); so a checkpoint's step counter and its weights always agree, and
a Ctrl-C in the middle of a rollout discards only that unfinished rollout.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import random
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.callbacks import BaseCallback

from opsched.agents.evaluate import ValidationEvaluator, policy_actor
from opsched.agents.runs import Run
from opsched.io import atomic_write_bytes, atomic_write_text

#: The evaluation figure that decides the best model: geometric-mean makespan
#: ratio against the fastest baseline of each validation pair (lower is better).
BEST_KEY = "gmean_best"


@dataclass
class TrainState:
    """What the callbacks share and a checkpoint restores."""

    run: Run
    best_score: float = float("inf")
    last_eval: int = -1
    last_checkpoint: int = 0
    rollout_start: int = 0          # num_timesteps when the current rollout began
    latest: dict[str, float] = field(default_factory=dict)
    stop_requested: bool = False
    pruned: bool = False
    wall_start: float = field(default_factory=time.time)
    wall_offset: float = 0.0        # seconds spent before a resume
    #: ``stop_when(phase)`` is asked at every point where training checks for
    #: Ctrl-C (``phase``: ``"imitation"``, ``"iteration"``, ``"evaluation"``,
    #: ``"rl"``); True stops the run there exactly as a Ctrl-C would.  The
    #: tests interrupt each phase with it.
    stop_when: Callable[[str], bool] | None = None

    def should_stop(self, phase: str) -> bool:
        """Whether training must stop now (Ctrl-C, or ``stop_when``)."""
        if not self.stop_requested and self.stop_when is not None and self.stop_when(phase):
            self.stop_requested = True
        return self.stop_requested

    @property
    def wall(self) -> float:
        return self.wall_offset + time.time() - self.wall_start


# --------------------------------------------------------------------- Ctrl-C
@contextmanager
def sigint_stops(state: TrainState, console: Any = None) -> Iterator[None]:
    """First Ctrl-C: ask training to stop at the next step (then checkpoint and exit
    cleanly).  A second Ctrl-C aborts at once (KeyboardInterrupt)."""
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        if state.stop_requested:
            raise KeyboardInterrupt
        state.stop_requested = True
        if console is not None:
            console.print("[yellow]Ctrl-C: stopping after this step and saving a checkpoint "
                          "(Ctrl-C again to abort)[/yellow]")

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no signal handling, training still works
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class StopOnRequest(BaseCallback):
    """Ends ``learn()`` at the next step once a stop was requested (Ctrl-C, pruning)."""

    def __init__(self, state: TrainState) -> None:
        super().__init__()
        self.state = state

    def _on_step(self) -> bool:
        return not (self.state.should_stop("rl") or self.state.pruned)


# ------------------------------------------------------------ RNG and checkpoints
def capture_rng(model: Any) -> dict[str, Any]:
    """Python, numpy, torch and every env's generator state, as JSON-able data."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: (name, keys, pos, has_gauss, cached_gaussian)
    py_state = random.getstate()
    envs = []
    for gen in model.get_env().get_attr("np_random"):
        envs.append(gen.bit_generator.state)
    return {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(th.get_rng_state().numpy().tobytes()).decode("ascii"),
        "envs": envs,
    }


def restore_rng(model: Any, rng: dict[str, Any]) -> None:
    """Undo :func:`capture_rng` (the env generators only when the env count matches)."""
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = rng["numpy"]
    np.random.set_state((npst[0], np.asarray(npst[1], dtype=np.uint32), npst[2], npst[3], npst[4]))
    th.set_rng_state(th.from_numpy(np.frombuffer(base64.b64decode(rng["torch"]), dtype=np.uint8).copy()))
    env = model.get_env()
    if len(rng.get("envs", [])) == env.num_envs:
        for i, st in enumerate(rng["envs"]):
            gen = np.random.Generator(getattr(np.random, st["bit_generator"])())
            gen.bit_generator.state = st
            env.set_attr("np_random", gen, indices=[i])


def save_model(model: Any, path: Any) -> None:
    """``model.save`` through a buffer and an atomic write: never a torn zip."""
    buf = io.BytesIO()
    model.save(buf)
    atomic_write_bytes(path, buf.getvalue())


def save_checkpoint(model: Any, state: TrainState, steps: int) -> None:
    """``checkpoints/step_<steps>.zip`` then its ``.json`` (step counter, best score,
    RNG states); the JSON is written last, so its presence marks a complete checkpoint."""
    zip_path, json_path = state.run.checkpoint_paths(steps)
    save_model(model, zip_path)
    meta = {
        "num_timesteps": int(steps),
        "best_score": state.best_score if np.isfinite(state.best_score) else None,
        "last_eval": state.last_eval,
        "evaluations": len(state.run.evaluations()),  # rows a resume keeps (later ones it writes again)
        "wall_s": state.wall,
        "rng": capture_rng(model),
    }
    atomic_write_text(json_path, json.dumps(meta) + "\n")
    state.last_checkpoint = steps


class CheckpointCallback(BaseCallback):
    """A checkpoint every ``every`` steps (at the next rollout boundary)."""

    def __init__(self, state: TrainState, every: int) -> None:
        super().__init__()
        self.state, self.every = state, int(every)

    def _on_rollout_start(self) -> None:
        self.state.rollout_start = self.num_timesteps
        if self.num_timesteps - self.state.last_checkpoint >= self.every:
            save_checkpoint(self.model, self.state, self.num_timesteps)

    def _on_step(self) -> bool:
        return True


# ----------------------------------------------------------------- evaluation
class ValidationEvalCallback(BaseCallback):
    """Evaluate on the validation set every ``every`` steps: TensorBoard, CSV, best model.

    ``on_eval(steps, row) -> bool`` (optional) sees each evaluation; returning
    True stops training (the Optuna pruner's hook)."""

    def __init__(self, state: TrainState, evaluator: ValidationEvaluator, every: int,
                 on_eval: Callable[[int, dict[str, float]], bool] | None = None) -> None:
        super().__init__()
        self.state, self.evaluator, self.every, self.on_eval = state, evaluator, int(every), on_eval

    def _on_rollout_start(self) -> None:
        if self.state.last_eval < 0 or self.num_timesteps - self.state.last_eval >= self.every:
            evaluate_now(self.model, self.state, self.evaluator, self.on_eval)

    def _on_step(self) -> bool:
        return True


def evaluate_now(model: Any, state: TrainState, evaluator: ValidationEvaluator,
                 on_eval: Callable[[int, dict[str, float]], bool] | None = None,
                 imitation_round: int = -1) -> dict[str, float] | None:
    """One validation evaluation of the current weights: log it, keep the best model.

    During the imitation warm start (``imitation_round >= 0``) the row's
    ``timesteps`` is 0 (no PPO step yet), it is logged under ``imitation/`` in
    TensorBoard (x = round) and not shown to ``on_eval`` (the pruner's steps
    are PPO steps)."""
    from opsched.agents.policy import hint_prior_scaled

    steps = int(model.num_timesteps)
    with hint_prior_scaled(model.policy, evaluator.prior_scale):
        result = evaluator.evaluate(policy_actor(model.policy), should_stop=lambda: state.should_stop("evaluation"))
    if result is None:
        return None
    row = {"timesteps": float(steps), "imitation_round": float(imitation_round), "wall_s": round(state.wall, 2),
           **result.row()}
    episodes = [ep["r"] for ep in (model.ep_info_buffer or [])]
    row["train_return"] = float(np.mean(episodes)) if episodes else float("nan")
    prefix = "validation" if imitation_round < 0 else "imitation/validation"
    for key, value in row.items():
        if key not in ("timesteps", "wall_s", "imitation_round"):
            model.logger.record(f"{prefix}/{key}", value)
    append_csv(state.run.evaluations_file, row)
    state.latest = row
    if imitation_round < 0:
        state.last_eval = steps
    if row[BEST_KEY] < state.best_score:
        state.best_score = row[BEST_KEY]
        save_model(model, state.run.best_model)
    if imitation_round < 0 and on_eval is not None and on_eval(steps, row):
        state.pruned = True
    return row


def append_csv(path: Any, row: dict[str, float]) -> None:
    """Append a row (header on first write); a resumed run keeps appending to the same file."""
    new = not path.exists()
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)
        fh.flush()


# ------------------------------------------------------------------- progress
class ProgressCallback(BaseCallback):
    """Moves a rich progress bar and shows the latest validation ratio in it."""

    def __init__(self, state: TrainState, progress: Any, task: Any) -> None:
        super().__init__()
        self.state, self.progress, self.task = state, progress, task

    def _on_step(self) -> bool:
        if self.n_calls % 16 == 0:
            self.refresh()
        return True

    def _on_rollout_start(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        latest = self.state.latest
        text = (f"validation ×{latest.get('gmean_best', float('nan')):.3f} vs best, "
                f"×{latest.get('gmean_cpf', float('nan')):.3f} vs cpf") if latest else "validation: pending"
        self.progress.update(self.task, completed=self.num_timesteps, validation=text)
