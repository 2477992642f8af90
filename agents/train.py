"""``train(config) -> Run``: MaskablePPO with the graph encoder, from the command
line to the gradient step.

The path, in order:

1. resolve the config (hyperparameter entry + ``--set`` overrides) and create
   the run folder (``runs/<name>_<N>``) -- or open it again for ``--resume``;
2. load the training graphs x machines and the held-out ones; compute the
   baselines' makespans on the held-out pairs once;
3. build ``n_envs`` ScheduleEnvs (SubprocVecEnv, or Ray actors: :mod:`opsched.agents.vec_envs`) and ``MaskablePPO(GraphPolicy, ...)``;
   restore a checkpoint (``--resume``) or a model (``--init``), else warm-start by
   imitation of the heuristics (:mod:`opsched.agents.imitation`);
4. ``model.learn(...)`` with callbacks that evaluate on the held-out set,
   keep the best model, checkpoint, show progress and stop on Ctrl-C;
5. save the final model, a checkpoint and the learning curve.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch as th
from rich.console import Console
from sb3_contrib import MaskablePPO
from stable_baselines3.common.callbacks import CallbackList
from stable_baselines3.common.logger import configure

from opsched.agents.callbacks import (
    BEST_KEY,
    CheckpointCallback,
    HeldOutEvalCallback,
    ProgressCallback,
    StopOnRequest,
    TrainState,
    evaluate_now,
    restore_rng,
    save_checkpoint,
    save_model,
    sigint_stops,
)
from opsched.agents.config import ConfigError, TrainConfig
from opsched.agents.evaluate import HeldOutEvaluator
from opsched.agents.model import build_model, load_trained_model, set_weights  # noqa: F401 (re-exported)
from opsched.agents.runs import Run, RunLock
from opsched.cache import graphs_dir
from opsched.io import atomic_write_text
from opsched.progress import progress_bar
from opsched.specs import load_graph, load_machine


def teachers() -> tuple[str, ...]:
    """The heuristics the imitation warm start copies (the fastest of them per training pair): the registry's teachers."""
    from opsched.policies import TEACHER, names

    return names(TEACHER)


def train(config: TrainConfig, *, argv: list[str] | None = None, progress: bool = True,
          on_eval: Any = None, console: Console | None = None) -> Run:
    """Train a policy into a fresh run folder ``<config.out>/<config.name>_<N>``.

    ``on_eval(steps, row) -> bool`` sees every held-out evaluation (True stops
    training: Optuna's pruner).  Ctrl-C stops cleanly with a checkpoint; the
    returned Run says ``interrupted``."""
    cfg = config.resolve()
    if cfg.init:
        cfg = _inherit_architecture(cfg, Run.open(cfg.init))
    run = Run.create(cfg, argv)
    return _train(run, cfg, checkpoint=None, progress=progress, on_eval=on_eval, console=console)


def resume(path: str | Path, *, timesteps: int | None = None, argv: list[str] | None = None,
           progress: bool = True, console: Console | None = None) -> Run:
    """Continue ``path`` from its last checkpoint: same folder, same config, the step
    counter and RNG states restored; ``timesteps`` raises the total (default: the run's)."""
    run = Run.open(path)
    cp = run.last_checkpoint()
    if cp is None:
        raise ConfigError(f"{path}: no checkpoint to resume from (checkpoints/ is empty)")
    cfg = run.config
    if timesteps is not None:
        cfg.timesteps = int(timesteps)
        atomic_write_text(run.config_file, cfg.to_yaml())
    run.record_command(argv)
    return _train(run, cfg, checkpoint=cp, progress=progress, on_eval=None, console=console)


def _inherit_architecture(cfg: TrainConfig, source: Run) -> TrainConfig:
    """Fine-tuning loads the source's weights, so the shapes must be the source's."""
    for key in ("hidden", "rounds"):
        cfg.ppo[key] = source.config.ppo[key]
    cfg.max_nodes = source.config.max_nodes
    cfg.level_times = source.config.level_times
    cfg.ppo["imitation_rounds"] = 0
    return cfg


def load_sets(cfg: TrainConfig) -> tuple[list[Any], list[Any]]:
    """The training graphs and machines (imported graphs cached in the per-user cache, :func:`opsched.cache.graphs_dir`)."""
    # real backends execute the graphs: traced afresh (a cached JSON graph has no torch source)
    cache = graphs_dir() if cfg.backend == "sim" else None
    graphs = [load_graph(s, cache_dir=cache) for s in cfg.train_graphs]
    machines = [load_machine(s) for s in cfg.train_machines]
    return graphs, machines


def _train(run: Run, cfg: TrainConfig, checkpoint: Any, progress: bool, on_eval: Any,
           console: Console | None) -> Run:
    console = console or Console(stderr=True)
    with RunLock(run.path):
        threads = th.get_num_threads()
        try:
            return _train_locked(run, cfg, checkpoint, progress, on_eval, console)
        finally:  # training's thread count must not leak into the caller (quickstart's eager run)
            th.set_num_threads(threads)


def _train_locked(run: Run, cfg: TrainConfig, checkpoint: Any, progress: bool, on_eval: Any,
                  console: Console) -> Run:
    t_setup = time.time()
    state = TrainState(run=run)
    if checkpoint is not None:
        meta = checkpoint.state()
        state.best_score = meta["best_score"] if meta.get("best_score") is not None else float("inf")
        state.last_eval = int(meta.get("last_eval", -1))
        state.last_checkpoint = state.rollout_start = checkpoint.steps
        state.wall_offset = float(meta.get("wall_s", 0.0))
    th.set_num_threads(cfg.torch_threads)

    with sigint_stops(state, console):
        graphs, machines = load_sets(cfg)
        evaluator = HeldOutEvaluator(cfg, cache_dir=graphs_dir())
        _write_baselines(run, evaluator)
        from opsched.agents.vec_envs import training_vec_env  # local workers or Ray actors, by config

        env = training_vec_env(cfg, graphs, machines, run.path)
        try:
            model = build_model(cfg, env, seed=None if checkpoint is not None else cfg.seed)
            model.set_logger(configure(str(run.tensorboard_dir), ["tensorboard"]))
            run.summary["setup_s"] = round(time.time() - t_setup, 2)
            if checkpoint is not None:
                set_weights(model, checkpoint.model, "checkpoint")
                model.num_timesteps = checkpoint.steps
                restore_rng(model, checkpoint.state()["rng"])
                console.print(f"resuming {run.path} from step {checkpoint.steps}")
            elif cfg.init:
                source = Run.open(cfg.init).model_for_init()
                set_weights(model, source, "--init")
                console.print(f"fine-tuning from {source}")
            elif cfg.ppo.get("imitation_rounds", 0) > 0 or cfg.ppo.get("iteration_rounds", 0) > 0:
                _warm_start(model, cfg, graphs, machines, state, evaluator, console, progress)
            _learn(model, cfg, state, evaluator, progress, on_eval, console, fresh=checkpoint is None)
            if cfg.backend != "sim" and not cfg.cluster and not run.interrupted and not state.pruned:
                _real_report(run, cfg, model, graphs, machines, console)  # measured here: a cluster's are not
        finally:
            env.close()
            evaluator.close()
            if "model" in locals():
                model.logger.close()
    run.num_timesteps = int(model.num_timesteps)
    run.best_score = state.best_score if np.isfinite(state.best_score) else None
    run.summary.update(latest=state.latest, wall_s=round(state.wall, 2), pruned=state.pruned)
    from opsched.agents.runs import plot_learning_curve

    plot_learning_curve(run)
    atomic_write_text(run.path / "summary.json", json.dumps(
        {"num_timesteps": run.num_timesteps, "best_score": run.best_score, "best_key": BEST_KEY,
         "interrupted": run.interrupted, **run.summary}, indent=2, default=float) + "\n")
    if not run.interrupted and not state.pruned:
        # The run's deliverable: RUN/policy/, planned with numpy only (issue 7).
        from opsched.agents.export import export_run

        export_run(run.path)
    return run


def _warm_start(model: MaskablePPO, cfg: TrainConfig, graphs: list, machines: list, state: TrainState,
                evaluator: HeldOutEvaluator, console: Console, progress: bool) -> None:
    """Imitation (DAgger of the best heuristic), then expert iteration
    (:mod:`opsched.agents.expert_iteration`); the validation set is evaluated
    after every round and PPO starts from the round that did best there (also
    saved as the best model)."""
    import copy

    from opsched.agents.expert_iteration import expert_iteration
    from opsched.agents.imitation import warm_start

    p = cfg.ppo
    pairs = [(g, m) for g in graphs for m in machines]
    from opsched.agents.vec_envs import warm_start_env

    env = warm_start_env(cfg, graphs, machines)
    t0 = time.time()
    best: dict[str, Any] = {}
    n_imitation = int(p.get("imitation_rounds", 0))
    n_iteration = int(p.get("iteration_rounds", 0))
    with progress_bar(console=console, enabled=progress, fields=("note",)) as bar:
        task = bar.add_task("imitation", total=n_imitation + n_iteration, note="")

        def after_round(r: int, stats: dict[str, float], phase: str, offset: int) -> None:
            for k in ("accuracy", "loss", "played_return"):
                model.logger.record(f"{phase}/{k}", stats[k])
            before = state.best_score
            save_model(model, state.run.path / "warm_start" / f"round_{offset + r}.zip")  # the learning curve's models
            row = evaluate_now(model, state, evaluator, imitation_round=offset + r)
            model.logger.dump(offset + r)
            if row is not None and state.best_score < before:
                best["round"], best["weights"] = offset + r, copy.deepcopy(model.policy.state_dict())
            note = "" if row is None else (f"validation x{row['gmean_best']:.3f} of the best heuristic "
                                           f"(worst x{row['worst_best']:.3f})")
            bar.update(task, completed=offset + r + 1, note=note)
            if not progress and row is not None:
                console.print(f"  {phase} round {r}: {note}")

        history = warm_start(
            model.policy, env, pairs, teachers(), rounds=n_imitation, steps=int(p["imitation_steps"]),
            lr=float(p["imitation_lr"]), batch_size=int(p["imitation_batch"]),
            first_episodes=int(p.get("imitation_first", len(pairs))),
            episodes_per_round=int(p.get("imitation_episodes", len(pairs))),
            keep=float(p.get("imitation_keep", 1.0)), seed=cfg.seed, log=lambda s: None,
            should_stop=lambda: state.stop_requested,
            after_round=lambda r, st: after_round(r, st, "imitation", 0),
            level_weight=float(p.get("imitation_level_weight", 0.0)), dagger=bool(p.get("imitation_dagger", True)))
        iteration: list[dict[str, float]] = []
        if n_iteration > 0 and not state.stop_requested:
            if "weights" in best:  # iterate from the best warm-start round
                model.policy.load_state_dict(best["weights"])
            bar.update(task, description="expert iteration")
            iteration = expert_iteration(
                model.policy, env, pairs, teachers(), rounds=n_iteration, pairs_per_round=int(p["iteration_pairs"]),
                samples=int(p["iteration_samples"]), temperature=float(p["iteration_temperature"]),
                search_budget=int(p["iteration_budget"]), steps=int(p["iteration_steps"]),
                lr=float(p["iteration_lr"]), batch_size=int(p["imitation_batch"]),
                episodes=int(p["iteration_episodes"]), keep=float(p.get("imitation_keep", 1.0)), seed=cfg.seed,
                log=console.print if not progress else lambda s: None, should_stop=lambda: state.stop_requested,
                after_round=lambda r, st: after_round(r, st, "iteration", n_imitation),
                level_weight=float(p.get("imitation_level_weight", 0.0)))
    if "weights" in best:
        model.policy.load_state_dict(best["weights"])
    state.run.summary["imitation"] = {"seconds": round(time.time() - t0, 2), "best_round": best.get("round"),
                                      "rounds": history, "iteration": iteration}
    env.close()


def _learn(model: MaskablePPO, cfg: TrainConfig, state: TrainState, evaluator: HeldOutEvaluator,
           progress: bool, on_eval: Any, console: Console, fresh: bool) -> None:
    run = state.run
    with progress_bar(console=console, enabled=progress, eta=False, fields=("heldout",)) as bar:
        task = bar.add_task(f"train {run.path.name}", total=cfg.timesteps, completed=model.num_timesteps,
                            heldout="held-out: pending")
        progress_cb = ProgressCallback(state, bar, task)
        if fresh and not state.stop_requested:
            evaluate_now(model, state, evaluator, on_eval)  # step 0: the warm-started (or initial) policy
            model.logger.dump(0)
            save_checkpoint(model, state, 0)
        remaining = cfg.timesteps - model.num_timesteps
        if remaining > 0 and not state.stop_requested and not state.pruned:
            callbacks = CallbackList([
                StopOnRequest(state),
                CheckpointCallback(state, cfg.checkpoint_freq),
                HeldOutEvalCallback(state, evaluator, cfg.eval_freq, on_eval),
                progress_cb,
            ])
            model.learn(total_timesteps=remaining, callback=callbacks, reset_num_timesteps=False,
                        tb_log_name=run.path.name)
        if state.stop_requested:
            # Only updates finished before the current rollout are in the weights.
            model.num_timesteps = state.rollout_start
            save_checkpoint(model, state, state.rollout_start)
            run.interrupted = True
            console.print(f"[yellow]stopped at step {state.rollout_start}: checkpoint saved in "
                          f"{run.checkpoint_dir}; continue with --resume {run.path}[/yellow]")
            return
        if state.pruned:
            return
        if state.last_eval != model.num_timesteps:
            evaluate_now(model, state, evaluator, on_eval)
        save_model(model, run.final_model)
        save_checkpoint(model, state, int(model.num_timesteps))
        progress_cb.refresh()


def _real_report(run: Run, cfg: TrainConfig, model: MaskablePPO, graphs: list, machines: list,
                 console: Console) -> None:
    """``real_makespans.json``: measured makespans of the policy training started
    from (the step-0 checkpoint: the ``--init`` model) and of the final one."""
    from opsched.agents.evaluate import real_comparison

    start = build_model(cfg, model.get_env(), seed=None)
    set_weights(start, run.checkpoints()[0].model, "checkpoint")
    rows = real_comparison({"start": start.policy, "final": model.policy},
                           dict(zip(cfg.train_graphs, graphs)), machines[0], cfg.max_nodes, cfg.backend)
    ratio = float(np.exp(np.mean([np.log(r["final"] / r["start"]) for r in rows])))
    atomic_write_text(run.path / "real_makespans.json", json.dumps(
        {"rows": rows, "gmean_final_over_start": ratio}, indent=2) + "\n")
    run.summary["real_gmean_final_over_start"] = ratio
    console.print(f"real makespans, final / start (geo-mean over {len(rows)} graphs): {ratio:.3f}")


def _write_baselines(run: Run, evaluator: HeldOutEvaluator) -> None:
    rows = [{"graph": p.graph_spec, "machine": p.machine_spec, "ops": len(p.graph.ops), **p.baselines}
            for p in evaluator.pairs]
    atomic_write_text(run.path / "heldout_baselines.json", json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `opsched train-policy`")
