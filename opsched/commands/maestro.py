"""``opsched maestro-train``: (re)train NN Maestro's multi-GPU classifier.

The classifier answers "does spreading this graph over the GPUs pay off?".
Its training set is simulated: for random graphs of every synthetic family, at
several sizes and batch scales, on each multi-GPU preset, Maestro's multi-GPU
schedule and its single-GPU schedule both run on the simulator, and the label
says whether the first is at least ``PAYOFF`` faster.  The zoo models (batch
1 and 8) are the test set, reported only.  The result is written as
plain JSON (``policies/maestro_svm.json`` by default, the file that ships).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.table import Table

from opsched.commands.app import app, console_for, progress_option, want_progress
from opsched.machine import PRESETS
from opsched.progress import progress_bar

#: The presets with two GPUs or more (what --machines may name).
MULTI_GPU_PRESETS = tuple(name for name, m in PRESETS.items() if len(m.gpus) >= 2)


def _ints(text: str, what: str) -> list[int]:
    from opsched.errors import OpschedError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise OpschedError(f"maestro-train: {what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise OpschedError(f"maestro-train: {what} must be positive integers, got {text!r}")
    return vals


@app.command("maestro-train")
def maestro_train_cmd(
    out: Path = typer.Option(None, "--out", show_default=False,
                             help="Where to write the classifier JSON (default: the shipped policies/maestro_svm.json)."),
    machines: str = typer.Option("2x2080ti,dgx1-4v100,4xa6000", "--machines",
                                 help=f"Comma-separated multi-GPU machines: presets ({', '.join(MULTI_GPU_PRESETS)}) "
                                      "or machine YAML files with two GPUs or more."),
    sizes: str = typer.Option("20,50,100,200", "--sizes", help="Comma-separated synthetic graph sizes (ops)."),
    scales: str = typer.Option("1,4,16,64", "--scales", help="Comma-separated batch scale factors applied to "
                               "each graph."),
    seeds: int = typer.Option(3, "--seeds", min=1, help="Random graphs per family and size."),
    zoo: bool = typer.Option(True, "--zoo/--no-zoo", help="Evaluate on the zoo models (the test set)."),
    c: float = typer.Option(10.0, "--C", help="SVM regularization (larger: fewer training errors tolerated)."),
    progress: Optional[bool] = progress_option(),
) -> None:
    """Train NN Maestro's SVM on simulated outcomes and save it as JSON."""
    from sklearn.model_selection import cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    from opsched.errors import OpschedError
    from opsched.machine import get_machine
    from opsched.policies.maestro import (
        DEFAULT_SVM_PATH,
        fit_svm,
        label_sample,
        pays_off,
        scale_graph,
        training_families,
    )
    from opsched.synthetic import generate

    console = console_for()
    mach = [get_machine(m.strip()) for m in machines.split(",") if m.strip()]
    if any(len(m.gpus) < 2 for m in mach):
        raise OpschedError("maestro-train: every --machines entry needs at least two GPUs")
    size_list, scale_list = _ints(sizes, "--sizes"), _ints(scales, "--scales")
    families = training_families()
    jobs = [(f, n, s, k, m) for m in mach for f in families for n in size_list for s in range(seeds)
            for k in scale_list]
    X, y = [], []
    prog = progress_bar(console=console_for(stderr=True), enabled=want_progress(progress))
    with prog:
        task = prog.add_task("simulating training graphs", total=len(jobs))
        for (family, opts), n, s, k, m in jobs:
            g = scale_graph(generate(family, n, s, **opts), k)
            feats, multi, single = label_sample(g, m)
            X.append(feats)
            y.append(pays_off(multi, single))
            prog.advance(task)
        Xa, ya = np.array(X), np.array(y, dtype=bool)
        if ya.all() or not ya.any():
            raise OpschedError("maestro-train: every training graph got the same label; widen --sizes/--scales")
        folds = max(2, min(5, int(ya.sum()), int((~ya).sum())))
        cv = cross_val_score(make_pipeline(StandardScaler(), SVC(kernel="rbf", C=c, gamma="scale",
                                                                 class_weight="balanced")), Xa, ya, cv=folds)
        holdout = []
        if zoo:
            from opsched.specs import load_graph
            from opsched.zoo import ZOO

            zjobs = [(name, b, m) for name in ZOO for b in (1, 8) for m in mach]
            ztask = prog.add_task("test zoo graphs", total=len(zjobs))
            graphs = {}
            for name, b, m in zjobs:
                if (name, b) not in graphs:
                    graphs[name, b] = load_graph(f"zoo:{name}", batch=b)
                feats, multi, single = label_sample(graphs[name, b], m)
                holdout.append((name, b, m.name, feats, multi, single))
                prog.advance(ztask)
    svm = fit_svm(Xa, ya, C=c, meta={
        "trained_on": f"synthetic {families} x sizes {size_list} x {seeds} seeds x scales {scale_list}",
        "machines": [m.name for m in mach], "cv_accuracy": float(cv.mean()), "cv_folds": folds,
        "label": "multi-GPU makespan < (1 - PAYOFF) x single-GPU makespan (simulated, analytic model)",
    })
    if holdout:
        pred = [svm.multi_gpu(f) for *_, f, _, _ in holdout]
        truth = [pays_off(mu, si) for *_, mu, si in holdout]
        acc = float(np.mean([p == t for p, t in zip(pred, truth)]))
        svm.meta["zoo_holdout_accuracy"] = acc
        t = Table(title="test zoo graphs")
        for col in ("graph", "batch", "machine", "multi / single makespan", "pays off", "SVM says"):
            t.add_column(col)
        for (name, b, mname, _, mu, si), p, tr in zip(holdout, pred, truth):
            t.add_row(name, str(b), mname, f"{mu / si:.2f}", str(tr), str(p),
                      style=None if p == tr else "red")
        console.print(t)
        console.print(f"zoo test accuracy: {acc:.2f}")
    path = out or DEFAULT_SVM_PATH
    svm.save(path)
    console.print(f"{len(ya)} samples ({int(ya.sum())} pay off), {len(svm.dual_coef)} support vectors, "
                  f"{folds}-fold CV accuracy {cv.mean():.2f}; written to [bold]{path}[/bold]")
