"""``train(config) -> Run``: MaskablePPO with the graph encoder, from the command
line to the gradient step.

The path, in order:

1. resolve the config (hyperparameter entry + ``--set`` overrides) and create
   the run folder (``runs/<name>_<N>``) -- or open it again for ``--resume``;
2. load the training graphs x machines and the validation ones; compute the
   baselines' makespans on the validation pairs once;
3. build ``n_envs`` ScheduleEnvs (SubprocVecEnv, or Ray actors: :mod:`opsched.agents.vec_envs`) and ``MaskablePPO(GraphPolicy, ...)``;
   restore a checkpoint (``--resume``) or a model (``--init``), else warm-start by
   imitation of the heuristics (:mod:`opsched.agents.imitation`);
4. ``model.learn(...)`` with callbacks that evaluate on the validation set,
   keep the best model, checkpoint, show progress and stop on Ctrl-C;
5. save the final model, a checkpoint and the learning curve.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from collections.abc import Callable
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
    ProgressCallback,
    StopOnRequest,
    TrainState,
    ValidationEvalCallback,
    evaluate_now,
    restore_rng,
    save_checkpoint,
    save_model,
    sigint_stops,
)
from opsched.agents.config import TrainConfig
from opsched.agents.evaluate import ValidationEvaluator
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
          on_eval: Any = None, console: Console | None = None,
          stop_when: Callable[[str], bool] | None = None) -> Run:
    """Train a policy into a fresh run folder ``<config.out>/<config.name>_<N>``.

    ``on_eval(steps, row) -> bool`` sees every validation evaluation (True stops
    training: Optuna's pruner).  Ctrl-C stops cleanly, keeping what every
    phase finished (warm-start rounds, PPO rollouts, evaluations); the returned
    Run says ``interrupted``.  ``stop_when(phase)``: stop there as Ctrl-C
    would (:attr:`~opsched.agents.callbacks.TrainState.stop_when`)."""
    cfg = config.resolve()
    if cfg.init:
        cfg = _inherit_architecture(cfg, Run.open(cfg.init))
    run = Run.create(cfg, argv)
    return _train(run, cfg, resuming=False, progress=progress, on_eval=on_eval, console=console,
                  stop_when=stop_when)


def resume(path: str | Path, *, timesteps: int | None = None, argv: list[str] | None = None,
           progress: bool = True, console: Console | None = None,
           stop_when: Callable[[str], bool] | None = None) -> Run:
    """Continue ``path`` where it stopped: in the warm start at its first
    unfinished round, in the RL phase from its last checkpoint (the step
    counter and RNG states restored), and evaluations it had not finished;
    same folder, same config.  ``timesteps`` raises the total (default: the run's)."""
    run = Run.open(path)
    cfg = run.config
    if timesteps is not None:
        cfg.timesteps = int(timesteps)
        atomic_write_text(run.config_file, cfg.to_yaml())
    run.record_command(argv)
    return _train(run, cfg, resuming=True, progress=progress, on_eval=None, console=console, stop_when=stop_when)


def _inherit_architecture(cfg: TrainConfig, source: Run) -> TrainConfig:
    """Fine-tuning loads the source's weights, so the shapes must be the source's."""
    for key in ("hidden", "rounds"):
        cfg.ppo[key] = source.config.ppo[key]
    cfg.max_nodes = source.config.max_nodes
    cfg.level_times = source.config.level_times
    cfg.hint_observation = source.config.hint_observation
    cfg.ppo["imitation_rounds"] = 0
    return cfg


def load_sets(cfg: TrainConfig) -> tuple[list[Any], list[Any]]:
    """The training graphs and machines (imported graphs cached in the per-user cache, :func:`opsched.cache.graphs_dir`)."""
    # real backends execute the graphs: traced afresh (a cached JSON graph has no torch source)
    cache = graphs_dir() if cfg.backend == "sim" else None
    graphs = [load_graph(s, cache_dir=cache) for s in cfg.train_graphs]
    machines = [load_machine(s) for s in cfg.train_machines]
    return graphs, machines


def _train(run: Run, cfg: TrainConfig, resuming: bool, progress: bool, on_eval: Any,
           console: Console | None, stop_when: Callable[[str], bool] | None = None) -> Run:
    console = console or Console(stderr=True)
    with RunLock(run.path):
        threads = th.get_num_threads()
        try:
            return _train_locked(run, cfg, resuming, progress, on_eval, console, stop_when)
        finally:  # training's thread count must not leak into the caller (quickstart's eager run)
            th.set_num_threads(threads)


def _warm_start_wanted(cfg: TrainConfig) -> bool:
    return not cfg.init and (cfg.ppo.get("imitation_rounds", 0) > 0 or cfg.ppo.get("iteration_rounds", 0) > 0)


def _train_locked(run: Run, cfg: TrainConfig, resuming: bool, progress: bool, on_eval: Any,
                  console: Console, stop_when: Callable[[str], bool] | None) -> Run:
    t_setup = time.time()
    state = TrainState(run=run, stop_when=stop_when)
    checkpoint = run.last_checkpoint() if resuming else None
    if checkpoint is not None:
        meta = checkpoint.state()
        state.best_score = meta["best_score"] if meta.get("best_score") is not None else float("inf")
        state.last_eval = int(meta.get("last_eval", -1))
        state.last_checkpoint = state.rollout_start = checkpoint.steps
        state.wall_offset = float(meta.get("wall_s", 0.0))
        if "evaluations" in meta:
            run.keep_evaluations(int(meta["evaluations"]))
    th.set_num_threads(cfg.torch_threads)

    with sigint_stops(state, console):
        graphs, machines = load_sets(cfg)
        evaluator = ValidationEvaluator(cfg, cache_dir=graphs_dir(), known=_read_baselines(run) if resuming else None)
        _write_baselines(run, evaluator)
        from opsched.agents.vec_envs import training_vec_env  # local workers or Ray actors, by config

        env = training_vec_env(cfg, graphs, machines, run.path)
        try:
            # a fresh run and a resumed warm start build the same initial network (cfg.seed)
            model = build_model(cfg, env, seed=None if checkpoint is not None else cfg.seed)
            model.set_logger(configure(str(run.tensorboard_dir), ["tensorboard"]))
            run.summary["setup_s"] = round(time.time() - t_setup, 2)
            done = True
            if checkpoint is not None:
                set_weights(model, checkpoint.model, "checkpoint")
                model.num_timesteps = checkpoint.steps
                restore_rng(model, checkpoint.state()["rng"])
                run.summary.update(_warm_start_summary(run))
                console.print(f"resuming {run.path} from step {checkpoint.steps}")
            elif cfg.init:
                source = Run.open(cfg.init).model_for_init()
                set_weights(model, source, "--init")
                console.print(f"fine-tuning from {source}")
            elif _warm_start_wanted(cfg):
                done = _warm_start(model, cfg, graphs, machines, state, evaluator, console, progress, resuming)
            if done and not state.stop_requested:
                _focus_rl(model, cfg, env, graphs, machines, run, console)
                _learn(model, cfg, state, evaluator, progress, on_eval, console, fresh=checkpoint is None)
            if state.stop_requested and not run.interrupted:
                run.interrupted = True
                console.print(f"[yellow]stopped in the warm start: the rounds it finished are kept in "
                              f"{run.warm_start_dir}; continue with --resume {run.path}[/yellow]")
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


def _teacher_fn(cfg: TrainConfig, graphs: list, machines: list, taught: set[tuple[int, int]]) -> Any:
    """The warm start's ``teacher(env)``: the best known plan (:mod:`opsched.agents.teachers`),
    or None for the best heuristic; records each taught pair as (graph index, machine index)."""
    if cfg.ppo.get("teacher", "heuristic") != "best-known":
        return None
    from opsched.agents.teachers import TeacherSettings, teacher_for_env

    gi = {id(g): i for i, g in enumerate(graphs)}
    mi = {id(m): i for i, m in enumerate(machines)}
    settings = TeacherSettings.from_hyperparameters(cfg.ppo)

    def teach(env: Any) -> Any:
        data = env.unwrapped.episode_data
        if id(data.graph) in gi and id(data.machine) in mi:
            taught.add((gi[id(data.graph)], mi[id(data.machine)]))
        return teacher_for_env(env, settings, cfg.seed)

    return teach


def _warm_start(model: MaskablePPO, cfg: TrainConfig, graphs: list, machines: list, state: TrainState,
                evaluator: ValidationEvaluator, console: Console, progress: bool, resuming: bool) -> bool:
    """Imitation (DAgger of the teacher: the best known plan of each training
    pair, or the best heuristic), then expert iteration
    (:mod:`opsched.agents.expert_iteration`); the validation set is evaluated
    after every round and PPO starts from the round that did best there (also
    saved as the best model).

    Resumable: every finished round saves the phase's state
    (:mod:`opsched.agents.rounds`), a resumed run continues at the first round
    not finished; the result is ``warm_start/final.zip`` with ``done.json``.
    Returns True when the warm start is complete (False: it was stopped)."""
    from opsched.agents import rounds as saved_rounds
    from opsched.agents.expert_iteration import expert_iteration
    from opsched.agents.imitation import warm_start
    from opsched.agents.vec_envs import warm_start_env

    run = state.run
    folder = run.warm_start_dir
    if resuming and (folder / "done.json").is_file() and (folder / "final.zip").is_file():
        set_weights(model, folder / "final.zip", "warm start")
        run.summary.update(_warm_start_summary(run))
        return True
    p = cfg.ppo
    n_imitation = int(p.get("imitation_rounds", 0))
    n_iteration = int(p.get("iteration_rounds", 0))
    imitation_saved = saved_rounds.load(folder / "imitation") if resuming else None
    iteration_saved = saved_rounds.load(folder / "iteration") if resuming else None
    latest = iteration_saved or imitation_saved
    best: dict[str, Any] = {}
    taught: set[tuple[int, int]] = set()
    if latest is not None:  # continue where the last finished round left the policy
        last = (n_imitation if iteration_saved else 0) + latest.next_round - 1
        set_weights(model, folder / f"round_{last}.zip", "warm start")
        state.best_score = latest.extra.get("best_score") or float("inf")
        if latest.best_round is not None:
            best["round"] = latest.best_round
        taught.update(tuple(x) for x in latest.extra.get("taught", []))
        run.keep_evaluations(latest.evaluations)
        console.print(f"resuming {run.path} in the warm start after round {last}")
    elif resuming:
        run.keep_evaluations(0)
        console.print(f"resuming {run.path} from the start of the warm start")
    pairs = [(g, m) for g in graphs for m in machines]
    env = warm_start_env(cfg, graphs, machines)
    teach = _teacher_fn(cfg, graphs, machines, taught)
    t0 = time.time()
    try:
        with progress_bar(console=console, enabled=progress, fields=("note",)) as bar:
            task = bar.add_task("imitation", total=n_imitation + n_iteration, note="")

            def after_round(r: int, stats: dict[str, float], phase: str, offset: int) -> None:
                for k in ("accuracy", "loss", "played_return"):
                    model.logger.record(f"{phase}/{k}", stats[k])
                before = state.best_score
                save_model(model, folder / f"round_{offset + r}.zip")  # the learning curve's models
                row = evaluate_now(model, state, evaluator, imitation_round=offset + r)
                model.logger.dump(offset + r)
                if row is not None and state.best_score < before:
                    best["round"] = offset + r
                    best.pop("weights", None)
                    best["weights"] = copy.deepcopy(model.policy.state_dict())
                note = "" if row is None else (f"validation x{row['gmean_best']:.3f} of the best heuristic "
                                               f"(worst x{row['worst_best']:.3f})")
                bar.update(task, completed=offset + r + 1, note=note)
                if not progress and row is not None:
                    console.print(f"  {phase} round {r}: {note}")

            def saver(phase: str) -> Any:
                def save(rs: Any, rng: np.random.Generator, opt: th.optim.Optimizer) -> None:
                    rs.best_round = best.get("round")
                    rs.evaluations = len(run.evaluations())
                    rs.extra = {"best_score": state.best_score if np.isfinite(state.best_score) else None,
                                "taught": sorted(taught)}
                    saved_rounds.save(folder / phase, rs, rng, opt)
                return save

            history = warm_start(
                model.policy, env, pairs, teachers(), rounds=n_imitation, steps=int(p["imitation_steps"]),
                lr=float(p["imitation_lr"]), batch_size=int(p["imitation_batch"]),
                first_episodes=int(p.get("imitation_first", len(pairs))),
                episodes_per_round=int(p.get("imitation_episodes", len(pairs))),
                keep=float(p.get("imitation_keep", 1.0)), seed=cfg.seed, log=lambda s: None,
                should_stop=lambda: state.should_stop("imitation"),
                after_round=lambda r, st: after_round(r, st, "imitation", 0),
                level_weight=float(p.get("imitation_level_weight", 0.0)), dagger=bool(p.get("imitation_dagger", True)),
                teacher=teach, resume=imitation_saved, save=saver("imitation"))
            iteration: list[dict[str, float]] = []
            if n_iteration > 0 and not state.stop_requested:
                if iteration_saved is None:  # iterate from the best warm-start round
                    _load_best(model, best, folder)
                bar.update(task, description="expert iteration")
                iteration = expert_iteration(
                    model.policy, env, pairs, teachers(), rounds=n_iteration, pairs_per_round=int(p["iteration_pairs"]),
                    samples=int(p["iteration_samples"]), temperature=float(p["iteration_temperature"]),
                    search_budget=int(p["iteration_budget"]), steps=int(p["iteration_steps"]),
                    lr=float(p["iteration_lr"]), batch_size=int(p["imitation_batch"]),
                    episodes=int(p["iteration_episodes"]), keep=float(p.get("imitation_keep", 1.0)), seed=cfg.seed,
                    log=console.print if not progress else lambda s: None,
                    should_stop=lambda: state.should_stop("iteration"),
                    after_round=lambda r, st: after_round(r, st, "iteration", n_imitation),
                    level_weight=float(p.get("imitation_level_weight", 0.0)),
                    teacher=teach, resume=iteration_saved, save=saver("iteration"))
    finally:
        env.close()
    if state.stop_requested:
        return False
    _load_best(model, best, folder)
    seconds = round(time.time() - t0, 2) + float(((latest.extra if latest else {}) or {}).get("seconds", 0.0))
    summary = {"seconds": seconds, "best_round": best.get("round"), "rounds": history, "iteration": iteration,
               "teacher": p.get("teacher", "heuristic"), "taught_pairs": len(taught)}
    save_model(model, folder / "final.zip")
    atomic_write_text(folder / "done.json", json.dumps({"imitation": summary, "taught": sorted(taught)},
                                                       indent=1, default=float) + "\n")
    run.summary["imitation"] = summary
    return True


def _load_best(model: MaskablePPO, best: dict[str, Any], folder: Path) -> None:
    """The best warm-start round's weights into ``model`` (kept in memory, or its round zip after a resume)."""
    if "weights" in best:
        model.policy.load_state_dict(best["weights"])
    elif best.get("round") is not None:
        set_weights(model, folder / f"round_{best['round']}.zip", "warm start")


def _warm_start_summary(run: Run) -> dict[str, Any]:
    done = run.warm_start_dir / "done.json"
    if not done.is_file():
        return {}
    body = json.loads(done.read_text())
    return {k: v for k, v in body.items() if k in ("imitation", "rl_pairs")}


def _focus_rl(model: MaskablePPO, cfg: TrainConfig, env: Any, graphs: list, machines: list, run: Run,
              console: Console) -> None:
    """Point the rollout workers at the RL phase's pairs (:mod:`opsched.agents.focus`):
    the taught pairs, weighted by how far the student's greedy plan is behind
    the teacher's (``rl_pairs: behind``) or all alike (``taught``); kept in
    ``rl_pairs.json`` so that a resumed run plays the same ones."""
    mode = cfg.ppo.get("rl_pairs", "all")
    if mode == "all" or cfg.timesteps <= model.num_timesteps:
        return
    from opsched.agents.vec_envs import focuses

    if not focuses(cfg):
        console.print(f"[yellow]rl_pairs={mode}: these workers play every training pair (profiled or real-backend "
                      "workers do not focus)[/yellow]")
        return
    path = run.path / "rl_pairs.json"
    if path.is_file():
        body = json.loads(path.read_text())
    else:
        body = _rl_pairs(model, cfg, graphs, machines, run, mode)
        atomic_write_text(path, json.dumps(body, indent=1) + "\n")
    if body["pairs"]:
        env.env_method("set_pairs", body["pairs"], body["weights"])
        run.summary["rl_pairs"] = {"mode": mode, "pairs": len(body["pairs"]),
                                   "behind": sum(1 for r in body["ratios"] if r > 1 + float(cfg.ppo.get("rl_margin", 0.0)))}


def _rl_pairs(model: MaskablePPO, cfg: TrainConfig, graphs: list, machines: list, run: Run,
              mode: str) -> dict[str, Any]:
    """The taught pairs with the student's greedy makespan over the teacher's, and their draw weights."""
    from opsched.agents.expert_iteration import numpy_encoder
    from opsched.agents.focus import behind_weights
    from opsched.agents.teachers import TeacherSettings
    from opsched.agents.vec_envs import warm_start_env
    from opsched.engine.slots import from_episode
    from opsched.policies.exported import decode_episode

    done = run.warm_start_dir / "done.json"
    if not done.is_file() and cfg.init:  # fine-tuning: the pairs the source run was taught
        done = Run.open(cfg.init).warm_start_dir / "done.json"
    taught = [tuple(x) for x in json.loads(done.read_text()).get("taught", [])] if done.is_file() else []
    if not taught:
        return {"pairs": [], "weights": [], "ratios": []}
    env = warm_start_env(cfg, graphs, machines)
    encoder = numpy_encoder(model.policy)
    settings = TeacherSettings.from_hyperparameters(cfg.ppo)
    ratios = []
    try:
        for g, m in taught:
            env.reset(options={"graph": graphs[g], "machine": machines[m]})
            data = env.unwrapped.episode_data
            student = from_episode(decode_episode(encoder, data)[0]).makespan
            ratios.append(float(student / settings.teach(data, env.unwrapped.model, cfg.seed).plan.makespan))
    finally:
        env.close()
    ones = [1.0] * len(taught)
    weights = behind_weights(ratios, ones, float(cfg.ppo.get("rl_margin", 0.0))) if mode == "behind" else ones
    return {"pairs": [list(p) for p in taught], "weights": [float(w) for w in weights], "ratios": ratios}


def _learn(model: MaskablePPO, cfg: TrainConfig, state: TrainState, evaluator: ValidationEvaluator,
           progress: bool, on_eval: Any, console: Console, fresh: bool) -> None:
    run = state.run
    with progress_bar(console=console, enabled=progress, eta=False, fields=("validation",)) as bar:
        task = bar.add_task(f"train {run.path.name}", total=cfg.timesteps, completed=model.num_timesteps,
                            validation="validation: pending")
        progress_cb = ProgressCallback(state, bar, task)
        if fresh:
            evaluate_now(model, state, evaluator, on_eval)  # step 0: the warm-started (or initial) policy
            if state.stop_requested:  # no checkpoint yet: a resume evaluates step 0 again
                run.interrupted = True
                console.print(f"[yellow]stopped before the RL phase began; continue with --resume {run.path}"
                              "[/yellow]")
                return
            model.logger.dump(0)
            save_checkpoint(model, state, 0)
        remaining = cfg.timesteps - model.num_timesteps
        if remaining > 0 and not state.stop_requested and not state.pruned:
            callbacks = CallbackList([
                StopOnRequest(state),
                CheckpointCallback(state, cfg.checkpoint_freq),
                ValidationEvalCallback(state, evaluator, cfg.eval_freq, on_eval),
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
            if state.stop_requested:  # the weights are final; a resume evaluates them
                save_checkpoint(model, state, int(model.num_timesteps))
                run.interrupted = True
                console.print(f"[yellow]stopped in the last evaluation: checkpoint saved; continue with --resume "
                              f"{run.path}[/yellow]")
                return
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


#: The baselines file of runs written before the validation split had that name.
_OLD_BASELINES = "heldout_baselines.json"


def _write_baselines(run: Run, evaluator: ValidationEvaluator) -> None:
    rows = [{"graph": p.graph_spec, "machine": p.machine_spec, "ops": len(p.graph.ops), **p.baselines}
            for p in evaluator.pairs]
    atomic_write_text(run.path / "validation_baselines.json", json.dumps(rows, indent=2) + "\n")


def _read_baselines(run: Run) -> list[dict[str, Any]] | None:
    """The baselines' makespans a run wrote (``validation_baselines.json``, or its
    old name), for a resumed run to reuse; None when absent or unreadable."""
    for name in ("validation_baselines.json", _OLD_BASELINES):
        path = run.path / name
        if path.is_file():
            try:
                rows = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
            return rows if isinstance(rows, list) and all(isinstance(r, dict) for r in rows) else None
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `opsched train-policy`")
