"""Export a trained policy (an SB3 MaskablePPO zip) as a numpy-only scheduler folder.

``export_run("runs/ppo_3")`` writes ``runs/ppo_3/policy/`` (``policy.json`` +
``weights.npz``, the format of :mod:`opsched.policies.exported`), which
:func:`opsched.policies.load` plans with -- no torch, stable-baselines3 or
gymnasium needed there.  This is the one place that reads a training run:
the model is rebuilt from the run's ``config.yaml`` and its tensors loaded
with ``set_parameters`` (our own training output; never unpickled objects),
then the graph encoder's ``state_dict`` is written as plain float32 arrays.

Before returning, the export is loaded back with the numpy loader and its
logits are compared with the torch policy's on real observations, so an
encoder whose computation drifted from the numpy implementation fails here,
loudly, rather than in a user's plan.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

import numpy as np

from opsched.errors import PolicyError

#: What ``export_run`` exports unless told otherwise: the best validation model.
DEFAULT_WHICH = "best"


def export_policy(policy: Any, out_dir: str | Path, *, machines: list[str] | None = None,
                  gpus: bool | None = None, source: dict[str, Any] | None = None,
                  max_graph_ops: int | None = None, verify: bool = True, hint_plan: bool = True) -> Path:
    """Write ``policy`` (a ``GraphPolicy`` or a ``MaskablePPO`` holding one) to
    ``out_dir`` as an exported policy folder and return the folder.

    ``machines``: the machine specs it was trained on (recorded; with ``gpus``
    None, whether any of them has a GPU decides if the policy may place ops on
    GPUs).  ``verify``: load the folder back and check the numpy logits against
    the torch policy's on a few observations.  ``hint_plan``: the policy was
    trained with the best heuristic's plan in its observation (``hint_observation``)."""
    from opsched.policies.exported import write_policy

    pol = getattr(policy, "policy", policy)
    encoder = getattr(pol, "encoder", None) or getattr(pol, "features_extractor", None)
    if encoder is None or not hasattr(encoder, "rounds"):
        raise PolicyError(f"export: {type(policy).__name__} has no graph encoder (expected opsched's GraphPolicy)")
    arrays = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in encoder.state_dict().items()}
    if gpus is None:
        gpus = _any_gpu(machines) if machines else True  # unknown machines: do not refuse GPUs
    out = write_policy(out_dir, arrays, hidden=int(encoder.hidden), rounds=int(encoder.rounds),
                       max_nodes=int(encoder.n_nodes), max_edges=int(encoder.n_edges), machines=machines,
                       gpus=gpus, max_graph_ops=max_graph_ops, source=source, hint_plan=hint_plan)
    if verify:
        verify_export(pol, out)
    return out


def export_run(run_dir: str | Path, which: str = DEFAULT_WHICH, out: str | Path | None = None,
               verify: bool = True) -> Path:
    """Export a training run's model to ``<run>/policy`` (or ``out``).

    ``which``: ``"best"`` (the best validation model; the final one if there is
    none yet), ``"final"``, or the path of a model zip inside the run."""
    from opsched.agents.config import ConfigError
    from opsched.agents.model import load_trained_model
    from opsched.agents.runs import Run

    run_dir = Path(run_dir)
    try:
        run = Run.open(run_dir)
    except ConfigError as exc:
        raise PolicyError(f"export: {exc}") from None
    zip_path = _model_zip(run, which)
    cfg = run.config
    try:
        model = load_trained_model(zip_path, env=_spaces_env(cfg))
    except Exception as exc:  # torch / SB3 raise many kinds on a bad zip
        raise PolicyError(f"export: cannot load {zip_path}: {type(exc).__name__}: {exc}") from exc
    steps, evaluation = _model_record(run, zip_path)
    source = {
        "run": str(run_dir), "model": zip_path.name, "num_timesteps": steps,
        "train_graphs": list(cfg.train_graphs), "validation_graphs": list(cfg.validation_graphs),
        "validation_machines": list(cfg.validation_machines), "hyperparams": cfg.hyperparams,
        "ppo": dict(cfg.ppo), "seed": cfg.seed, "test_split_overlap": cfg.test_overlap(),
        "exported_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "opsched_version": _version(),
    }
    if evaluation is not None:
        source["evaluation"] = evaluation  # its validation figures (makespan ratios to the baselines)
    return export_policy(model, out if out is not None else run_dir / "policy",
                         machines=list(cfg.train_machines), source=source, verify=verify,
                         hint_plan=cfg.hint_observation)


def verify_export(policy: Any, folder: str | Path, n_states: int = 8) -> None:
    """Load ``folder`` with the numpy loader and compare its logits on the valid
    actions of ``n_states`` observations (a small graph on a GPU machine and on
    a CPU one) with the torch policy's; raise PolicyError on a mismatch."""
    import torch as th

    from opsched.envs.schedule_env import ScheduleEnv
    from opsched.policies.exported import load
    from opsched.synthetic import generate

    exported = load(folder)
    encoder = getattr(policy, "encoder", None) or policy.features_extractor
    env = ScheduleEnv(graphs=[generate("layered", 24, 7)], machine=["dgx1-4v100", "xeon-8180-2s"],
                      max_nodes=exported.max_nodes, max_edges=exported.max_edges, hint_plan=exported.hint_plan)
    rng = np.random.default_rng(0)
    worst = 0.0
    for k in range(n_states):
        obs, _ = env.reset(seed=k)
        for _ in range(int(rng.integers(0, 12))):  # a few random valid steps into the episode
            obs, _, done, _, _ = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
            if done:
                obs, _ = env.reset(seed=k)
        valid = np.flatnonzero(env.action_masks())
        batch = {key: th.as_tensor(np.asarray(v)[None]) for key, v in obs.items()}
        with th.no_grad():
            ref = encoder.logits_and_value(batch)[0][0].numpy()
        mine, _ = exported.encoder.forward(obs)
        scale = max(1.0, float(np.abs(ref[valid]).max()))
        worst = max(worst, float(np.abs(mine[valid] - ref[valid]).max()) / scale)
    env.close()
    if worst > 1e-4:
        raise PolicyError(f"{folder}: the numpy scheduler's logits differ from the torch policy's by {worst:.3g} "
                          "(relative); the graph encoder and opsched/policies/numpy_encoder.py have drifted apart")


def _model_zip(run: Any, which: str) -> Path:
    if which == "best":
        for p in (run.best_model, run.final_model):
            if p.is_file():
                return p
        cp = run.last_checkpoint()
        if cp is not None:
            return cp.model
        raise PolicyError(f"export: {run.path} has no model yet (no best_model.zip, final_model.zip or checkpoint)")
    if which == "final":
        if not run.final_model.is_file():
            raise PolicyError(f"export: {run.final_model}: no such file (training did not finish; try --which best)")
        return run.final_model
    p = Path(which)
    if not p.is_file():
        raise PolicyError(f"export: {p}: no such model file (use best, final, or a zip inside the run)")
    return p


def _model_record(run: Any, zip_path: Path) -> tuple[int | None, dict[str, float] | None]:
    """(training steps, validation evaluation row) of the model being exported:
    the best-scoring evaluation for the best model, the last one for the final
    model, the one at the checkpoint's step for a checkpoint."""
    from opsched.agents.callbacks import BEST_KEY

    evals = run.evaluations()
    if zip_path.resolve() == run.best_model.resolve() and evals:
        row = min(evals, key=lambda r: r.get(BEST_KEY, float("inf")))
        return int(row["timesteps"]), row
    if zip_path.resolve() == run.final_model.resolve():
        return (int(evals[-1]["timesteps"]), evals[-1]) if evals else (None, None)
    for cp in run.checkpoints():
        if cp.model.resolve() == zip_path.resolve():
            row = next((r for r in evals if int(r["timesteps"]) == cp.steps), None)
            return cp.steps, row
    return None, None


def _spaces_env(cfg: Any) -> Any:
    """A cheap env with the run's observation and action spaces (they depend
    only on ``max_nodes``), so loading a model needs no zoo import."""
    from opsched.agents.environments import make_env
    from opsched.machine import get_machine
    from opsched.synthetic import generate

    return make_env([generate("layered", 8, 0)], [get_machine("xeon-8180-2s")], int(cfg.max_nodes))


def _any_gpu(specs: list[str]) -> bool:
    from opsched.specs import load_machine

    out = False
    for s in specs:
        try:
            out = out or bool(load_machine(s).gpus)
        except Exception:  # an unreadable spec cannot prove CPU-only: allow GPUs
            return True
    return out


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("opsched")
    except Exception:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    """``python -m opsched.agents.export RUN [--out DIR]`` (as ``opsched export``); the shipped
    policy is trained and exported by ``python -m opsched.agents.pretrained``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m opsched.agents.export", description=main.__doc__)
    ap.add_argument("what", help="a run folder")
    ap.add_argument("--out", default=None, help="output folder")
    args = ap.parse_args(argv)
    if args.what == "pretrained":
        raise SystemExit("the shipped policy is made by `python -m opsched.agents.pretrained`")
    folder = export_run(args.what, out=args.out)
    print(f"exported to {folder}")


__all__ = ["export_policy", "export_run", "verify_export"]


if __name__ == "__main__":
    main()
