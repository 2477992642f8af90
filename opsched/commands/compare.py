"""``opsched compare``: every policy on every graph, through one backend, like for like.

Each policy plans each graph (the time it takes to decide is recorded), then
the plans run on the chosen backend.  On the simulator one run is exact (unless
``--noise``); on a real backend every (graph, policy) gets ``--warmup`` untimed
runs, then ``--repeats`` timed rounds that visit the policies round-robin,
starting one further along each round, so drift on a shared machine hits all
of them alike; the median and the spread are reported.  ``sequential`` is
always included: it is the reference of the speedup column.

Output, in ``<out>/compare_<N>/``: ``results.csv`` and ``results.json``, the
bar chart ``speedup.png``, a Gantt chart per policy and graph under
``gantt/``, every plan under ``plans/`` (replayable), and ``command.txt``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opsched.cli import app
from opsched.errors import OpschedError

CSV_FIELDS = ("graph", "policy", "backend", "machine", "n_ops", "makespan_s", "min_s", "max_s", "iqr_s",
              "repeats", "speedup", "lb_ratio", "decision_s", "lower_bound_s")


@dataclass
class Result:
    """One policy on one graph."""

    graph: str
    policy: str
    n_ops: int
    decision_s: float
    times: list[float] = field(default_factory=list)
    plan: Any = None
    trace: Any = None  # the median run's trace
    plan_meta: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return float(np.median(self.times))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else float("nan")


def command_line(params: dict[str, Any]) -> str:
    """The command as typed when run through the ``opsched`` entry point;
    otherwise (e.g. from Python) the equivalent command rebuilt from the options."""
    if Path(sys.argv[0]).name == "opsched" and len(sys.argv) > 1 and sys.argv[1] == "compare":
        return shlex.join(["opsched", *sys.argv[1:]])
    parts = ["opsched", "compare"]
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            parts += [flag, str(value)]
    return shlex.join(parts)


MODELS = ("auto", "analytic", "fitted")


def model_for(choice: str, machine: Any, backend_name: str) -> Any:
    """The performance model the policies plan with (and the simulator runs).

    ``auto``: on a real backend, the model fitted to this machine's cached
    profiles when there are any (``opsched profile``), else the analytic one;
    on the simulator, the analytic model, so a preset's figures do not depend
    on which profiles happen to be cached.  ``fitted`` insists on profiles."""
    from opsched.backends.perfmodel import default_model

    if choice not in MODELS:
        raise OpschedError(f"compare: --model must be one of {', '.join(MODELS)}, got {choice!r}")
    if choice == "analytic" or (choice == "auto" and backend_name == "sim"):
        return default_model()
    from opsched.backends.fitted import FittedModel, fitted_or_analytic

    return FittedModel.from_cache(machine) if choice == "fitted" else fitted_or_analytic(machine)


def _time_of(trace: Any, measured: bool) -> float:
    """A real run's wall time when the backend recorded one, else its makespan."""
    if measured and "wall_s" in trace.meta:
        return float(trace.meta["wall_s"])
    return float(trace.makespan)


def _framework(graph: Any) -> str:
    """The framework a graph's executable source comes from."""
    return "TensorFlow" if type(graph.source).__name__ == "TFSource" else "PyTorch"


def _distinct_names(policies: list) -> list:
    """Give policies that share a name (two exported policies are both
    "learned") a label from their folder - ``learned (quickstart_1)``,
    ``learned (pretrained)`` - so tables, plans and plots keep them apart."""
    counts: dict[str, int] = {}
    for p in policies:
        counts[p.name] = counts.get(p.name, 0) + 1
    for p in policies:
        folder = getattr(p, "folder", None)
        if counts[p.name] > 1 and folder is not None:
            folder = Path(folder)
            p.name = f"{p.name} ({folder.parent.name if folder.name == 'policy' else folder.name})"
    return policies


def _framework_of_backend(name: str) -> str:
    return "TensorFlow" if name == "tf" else "PyTorch"


def run_compare(graphs: list[str], machine_name: str, backend_name: str, policy_spec: str, *, batch: int = 1,
                width: float = 1.0, repeats: int | None = None, warmup: int = 1, out: str | Path = "runs",
                seed: int = 0, noise: float = 0.0, search_trials: int = 100, gantt: bool = True,
                model: str = "auto", command: str = "",
                console: Console | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """Run the comparison and write the run folder; returns (folder, result rows)."""
    from opsched.backends.registry import get_backend
    from opsched.backends.sim import cached_fingerprint, lower_bound
    from opsched.io import atomic_write_text, next_run_dir
    from opsched.machine import get_machine
    from opsched.models import load_graph
    from opsched.policies import expand_names, get_policy, timed_plan

    console = console or Console()
    if batch < 1 or width <= 0 or warmup < 0 or (repeats is not None and repeats < 1):
        raise OpschedError("compare: --batch and --repeats must be >= 1, --width > 0, --warmup >= 0")
    machine = get_machine(machine_name)
    cached_fingerprint(machine)
    if backend_name != "sim" and machine.name != "local":
        raise OpschedError(f"compare: --backend {backend_name} measures this machine; use --machine local "
                           f"(not {machine_name!r}), or --backend sim for a preset")
    names = expand_names(policy_spec)
    if "sequential" not in names:
        names.insert(0, "sequential")
    kwargs = {"random": {"seed": seed}, "search": {"n_trials": search_trials, "seed": seed}}
    policies = _distinct_names([get_policy(n, **kwargs.get(n, {})) for n in names])
    model_name = model
    model = model_for(model_name, machine, backend_name)
    backend_kwargs = {"model": model, "noise": noise, "seed": seed} if backend_name == "sim" else {}
    with get_backend(backend_name, machine, **backend_kwargs) as backend:
        measured = bool(getattr(backend, "measured", False))
        if repeats is None:
            repeats = 5 if measured or noise > 0 else 1
        results: dict[str, list[Result]] = {}
        bounds: dict[str, float] = {}
        loaded = []
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=False)
        with progress:
            t_load = progress.add_task("loading graphs", total=len(graphs))
            for spec in graphs:
                graph = load_graph(spec, batch=batch, width=width, seed=seed)
                if measured and graph.source is None:
                    raise OpschedError(f"compare: graph {spec!r} has no executable source; synthetic and JSON "
                                       "graphs run only on --backend sim")
                if measured and _framework(graph) != _framework_of_backend(backend_name):
                    raise OpschedError(f"compare: graph {spec!r} is a {_framework(graph)} model; --backend "
                                       f"{backend_name} runs {_framework_of_backend(backend_name)} models "
                                       f"(use --backend {'tf' if _framework(graph) == 'TensorFlow' else 'torch-cpu'})")
                cached_fingerprint(graph)  # hashed once here, not inside the first policy's decision time
                loaded.append((spec, graph))
                bounds[spec] = float(lower_bound(graph, machine, model))
                progress.advance(t_load)
            run_dir = next_run_dir(out, "compare")  # only once every graph loaded: no empty folders
            atomic_write_text(run_dir / "command.txt", command + "\n")
            t_plan = progress.add_task("planning", total=len(graphs) * len(policies))
            for spec, graph in loaded:
                results[spec] = []
                for pol in policies:
                    progress.update(t_plan, description=f"planning {spec}: {pol.name}")
                    plan, dt = timed_plan(pol, graph, machine, model)
                    plan.save(run_dir / "plans" / f"{_safe(spec)}__{_safe(pol.name)}.json")
                    results[spec].append(Result(spec, pol.name, len(graph.ops), dt, plan=plan,
                                                plan_meta=dict(plan.meta)))
                    progress.advance(t_plan)
            n_runs = len(graphs) * len(policies) * (repeats + (warmup if measured else 0))
            t_run = progress.add_task(f"running on {backend_name}", total=n_runs)
            for spec, graph in loaded:
                rows = results[spec]
                traces: list[list[Any]] = [[] for _ in rows]
                if measured:
                    for r in rows:
                        for _ in range(warmup):
                            backend.run(graph, r.plan)
                            progress.advance(t_run)
                for k in range(repeats):
                    for j in range(len(rows)):
                        r = rows[(j + k) % len(rows)]  # round-robin, rotated each round
                        progress.update(t_run, description=f"running {spec}: {r.policy} ({k + 1}/{repeats})")
                        trace = backend.run(graph, r.plan)
                        r.times.append(_time_of(trace, measured))
                        traces[(j + k) % len(rows)].append(trace)
                        progress.advance(t_run)
                for r, ts in zip(rows, traces):
                    r.trace = ts[int(np.argsort(r.times)[len(r.times) // 2])]
            if gantt:
                t_plot = progress.add_task("Gantt charts", total=len(graphs) * len(policies))
                for spec, graph in loaded:
                    for r in results[spec]:
                        r.trace.plot(run_dir / "gantt" / f"{_safe(spec)}__{_safe(r.policy)}.png", graph,
                                     title=f"{spec} / {r.policy} on {machine.name} ({backend_name}): "
                                           f"{r.median * 1e3:.3g} ms")
                        progress.advance(t_plot)
    rows = _rows(results, bounds, backend_name, machine.name, repeats)
    _write(run_dir, rows, results, dict(graphs=graphs, machine=machine.to_dict(), backend=backend_name,
                                       policies=names, batch=batch, width=width, repeats=repeats,
                                       warmup=warmup if measured else 0, seed=seed, noise=noise,
                                       model=type(model).__name__, model_choice=model_name,
                                       command=command, python=platform.python_version()))
    _print_tables(console, rows, results, machine.name, backend_name, measured)
    console.print(f"policies planned with the {type(model).__name__} performance model ({model_name})")
    console.print(f"results in [bold]{run_dir}[/bold]")
    return run_dir, rows


def _rows(results: dict[str, list[Result]], bounds: dict[str, float], backend: str, machine: str,
          repeats: int) -> list[dict[str, Any]]:
    rows = []
    for spec, rs in results.items():
        seq = next(r for r in rs if r.policy == "sequential").median
        for r in rs:
            t = np.asarray(r.times)
            rows.append({
                "graph": spec, "policy": r.policy, "backend": backend, "machine": machine, "n_ops": r.n_ops,
                "makespan_s": r.median, "min_s": float(t.min()), "max_s": float(t.max()),
                "iqr_s": float(np.percentile(t, 75) - np.percentile(t, 25)), "repeats": repeats,
                "speedup": seq / r.median if r.median > 0 else float("nan"),
                "lb_ratio": r.median / bounds[spec] if bounds[spec] > 0 else float("nan"),
                "decision_s": r.decision_s, "lower_bound_s": bounds[spec],
            })
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        rows.append({
            "graph": "geomean", "policy": p, "backend": backend, "machine": machine, "n_ops": None,
            "makespan_s": None, "min_s": None, "max_s": None, "iqr_s": None, "repeats": repeats,
            "speedup": _geomean([r["speedup"] for r in mine]), "lb_ratio": _geomean([r["lb_ratio"] for r in mine]),
            "decision_s": _geomean([r["decision_s"] for r in mine]), "lower_bound_s": None,
        })
    return rows


def _write(run_dir: Path, rows: list[dict[str, Any]], results: dict[str, list[Result]],
           config: dict[str, Any]) -> None:
    from opsched.io import atomic_write_bytes, atomic_write_text

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(run_dir / "results.csv", buf.getvalue())
    runs = {spec: {r.policy: {"times_s": r.times, "plan_meta": r.plan_meta} for r in rs}
            for spec, rs in results.items()}
    atomic_write_text(run_dir / "results.json",
                      json.dumps({"config": config, "results": rows, "runs": runs}, indent=1, default=str))
    atomic_write_bytes(run_dir / "speedup.png", _speedup_png(rows))


def _speedup_png(rows: list[dict[str, Any]]) -> bytes:
    """Grouped bars: one group per graph (and the geometric mean), one bar per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    speed = {(r["graph"], r["policy"]): r["speedup"] for r in rows}
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 1.0 + 0.22 * len(graphs) * len(policies))), 4.5))
    w = 0.8 / len(policies)
    x = np.arange(len(graphs))
    cmap = plt.get_cmap("tab10")
    for k, p in enumerate(policies):
        ax.bar(x + (k - (len(policies) - 1) / 2) * w, [speed.get((g, p), np.nan) for g in graphs], w,
               label=p, color=cmap(k % 10))
    ax.axhline(1.0, color="black", linewidth=0.8)
    finite = [v for v in speed.values() if v and math.isfinite(v)]
    if finite and max(finite) / min(finite) > 30:  # e.g. 30x on a manycore CPU next to 0.5x
        ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(graphs, rotation=20, ha="right")
    ax.set_ylabel("speedup over sequential")
    ax.set_title(f"{rows[0]['machine']} ({rows[0]['backend']})")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _print_tables(console: Console, rows: list[dict[str, Any]], results: dict[str, list[Result]],
                  machine: str, backend: str, measured: bool) -> None:
    for spec in results:
        mine = [r for r in rows if r["graph"] == spec]
        t = Table(title=f"{spec} on {machine} ({backend}, {mine[0]['n_ops']} ops)")
        for col in ("policy", "makespan ms" + (" (median)" if measured else ""), "spread", "speedup",
                    "/ lower bound", "decision ms"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        best = min(r["makespan_s"] for r in mine)
        for r in mine:
            spread = f"±{100 * r['iqr_s'] / r['makespan_s'] / 2:.1f}%" if r["repeats"] > 1 else "-"
            style = "bold green" if r["makespan_s"] == best else None
            t.add_row(r["policy"], f"{r['makespan_s'] * 1e3:.4g}", spread, f"{r['speedup']:.2f}x",
                      f"{r['lb_ratio']:.2f}", f"{r['decision_s'] * 1e3:.3g}", style=style)
        console.print(t)
    graphs = list(results)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    speed = {(r["graph"], r["policy"]): r["speedup"] for r in rows}
    t = Table(title=f"speedup over sequential on {machine} ({backend})")
    t.add_column("graph")
    for p in policies:
        t.add_column(p, justify="right")
    for g in [*graphs, "geomean"]:
        t.add_row(g, *(f"{speed[g, p]:.2f}x" for p in policies), style="bold" if g == "geomean" else None)
    console.print(t)


@app.command("compare")
def compare_cmd(
    ctx: typer.Context,
    graphs: str = typer.Option("zoo:inception,zoo:randwire", "--graphs", "-g",
                               help="Comma-separated graphs: zoo:NAME, synthetic:FAMILY, or graph JSON files."),
    machine: str = typer.Option("local", "--machine", "-m", help="A preset name, 'local', or a machine YAML."),
    backend: str = typer.Option("sim", "--backend", "-b", help="sim, torch-cpu, torch-cuda or tf."),
    policies: str = typer.Option("all", "--policies", "-p",
                                 help="Comma-separated policy names; 'all' = every heuristic; "
                                      "'search' or an exported policy path may be added."),
    batch: int = typer.Option(1, "--batch", help="Batch size of the zoo models."),
    width: float = typer.Option(1.0, "--width", help="Width multiplier of the zoo models."),
    repeats: int | None = typer.Option(None, "--repeats",
                                       help="Timed runs per policy (default 5 on real backends, 1 on sim)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed runs per policy first (real backends)."),
    out: Path = typer.Option(Path("runs"), "--out", help="Parent folder of the compare_<N> run folder."),
    seed: int = typer.Option(0, "--seed", help="Seed for graphs, random plans, search and sim noise."),
    noise: float = typer.Option(0.0, "--noise", help="Simulator measurement noise (relative std)."),
    search_trials: int = typer.Option(100, "--search-trials", help="Trial budget of the 'search' policy."),
    gantt: bool = typer.Option(True, "--gantt/--no-gantt", help="Draw a Gantt chart per policy and graph."),
    model: str = typer.Option("auto", "--model",
                              help="Performance model the policies plan with: auto (fitted to this machine's "
                                   "cached profiles on real backends, analytic on sim), analytic, or fitted."),
) -> None:
    """Compare scheduling policies on graphs: makespan, speedup, distance to the lower bound."""
    params = {k: v for k, v in ctx.params.items()}
    specs = list(dict.fromkeys(g.strip() for g in graphs.split(",") if g.strip()))
    if not specs:
        raise OpschedError("compare: --graphs names no graph")
    run_compare(specs, machine, backend, policies, batch=batch, width=width, repeats=repeats, warmup=warmup,
                out=out, seed=seed, noise=noise, search_trials=search_trials, gantt=gantt, model=model,
                command=command_line(params))
