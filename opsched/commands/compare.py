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

The ceiling columns (issue 23): ``lower_bound_s`` is max(critical path,
work / capacity); ``lp_bound_s`` the allocation LP's bound
(:func:`opsched.engine.bounds.allocation_lp_bound`), and ``tight_lb_ratio`` the
makespan over the tighter of the two (and CP-SAT's proven bound when the
``cpsat`` policy ran: ``--ceiling-s S`` adds it with S seconds per graph);
``best_known_s`` is the fastest plan of this comparison for the graph and
``best_known_ratio`` the makespan over it (``opsched.ceiling.best_known``
searches harder).  The bounds are the simulator's: on a real backend they
say how far the plans are from the model's limit, not the machine's.
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
from rich.table import Table

from opsched.backends.registry import help_text
from opsched.commands.app import app, console_for, progress_option, want_progress
from opsched.engine.contracts import WorkerProcesses
from opsched.errors import OpschedError
from opsched.progress import progress_bar

CSV_FIELDS: tuple[str, ...] = (
    "graph", "policy", "backend", "machine", "n_ops", "makespan_s", "min_s", "max_s", "iqr_s",
    "repeats", "speedup", "lb_ratio", "decision_s", "lower_bound_s",
    "lp_bound_s", "tight_lb_ratio", "best_known_s", "best_known_ratio")


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


def _time_of(trace: Any, measured: bool) -> float:
    """A real run's wall time when the backend recorded one, else its makespan."""
    if measured and "wall_s" in trace.meta:
        return float(trace.meta["wall_s"])
    return float(trace.makespan)


#: The importer an executable graph source comes from (what a backend spec's ``runs`` names).
_IMPORTER_OF_SOURCE = {"OnnxSource": "onnx", "TFSource": "keras", "TorchSource": "torch"}
_WORDS = {"onnx": "ONNX", "keras": "TensorFlow", "torch": "PyTorch"}


def _importer(graph: Any) -> str:
    """The importer (``torch``, ``keras``, ``onnx``) of a graph's executable source."""
    return _IMPORTER_OF_SOURCE.get(type(graph.source).__name__, "torch")


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


def _backend_for(importer: str) -> str:
    """The first registered real backend that runs graphs of ``importer``."""
    from opsched.backends.registry import BACKENDS

    return next((s.name for s in BACKENDS.values() if s.real and importer in s.runs), "torch-cpu")


def run_compare(graphs: list[str], machine_name: str, backend_name: str, policy_spec: str, *, batch: int = 1,
                width: float = 1.0, repeats: int | None = None, warmup: int = 1, out: str | Path = "runs",
                seed: int = 0, noise: float = 0.0, search_trials: int = 100, gantt: str = "best",
                perf_model: str = "auto", command: str = "", progress: bool = True, ceiling_s: float = 0.0,
                console: Console | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """Run the comparison and write the run folder; returns (folder, result rows)."""
    from opsched.backends.registry import BACKENDS, get_backend, spec
    from opsched.engine.bounds import allocation_lp_bound
    from opsched.engine.sim import cached_fingerprint, lower_bound
    from opsched.io import atomic_write_text, next_run_dir
    from opsched.planning import describe, planning_model
    from opsched.policies import expand_names, get_policy, timed_plan
    from opsched.specs import load_graph, load_machine
    from opsched.timing import Timings, interleave

    console = console or Console()
    if batch < 1 or width <= 0 or warmup < 0 or (repeats is not None and repeats < 1):
        raise OpschedError("compare: --batch and --repeats must be >= 1, --width > 0, --warmup >= 0")
    if search_trials < 1:
        raise OpschedError(f"compare: --search-trials must be >= 1, got {search_trials}")
    if ceiling_s < 0:
        raise OpschedError(f"compare: --ceiling-s must be >= 0, got {ceiling_s}")
    if gantt not in GANTT:
        raise OpschedError(f"compare: --gantt must be one of {', '.join(GANTT)}, got {gantt!r}")
    if backend_name not in BACKENDS:
        raise OpschedError(f"compare: unknown backend {backend_name!r}; choose from {', '.join(BACKENDS)}")
    be_spec = spec(backend_name)
    machine = load_machine(machine_name)  # presets, YAML, cpu:..., random:SEED, hard:NAME:SEED
    cached_fingerprint(machine)
    if be_spec.real and machine.name != "local":
        raise OpschedError(f"compare: --backend {backend_name} measures this machine; use --machine local "
                           f"(not {machine_name!r}), or --backend sim for a preset")
    names = expand_names(policy_spec)
    if "sequential" not in names:
        names.insert(0, "sequential")
    if ceiling_s > 0 and "cpsat" not in names:
        names.append("cpsat")
    kwargs = {"random": {"seed": seed}, "search": {"n_trials": search_trials, "seed": seed},
              "cpsat": {"time_limit_s": ceiling_s or 10.0, "seed": seed}}
    policies = _distinct_names([get_policy(n, **kwargs.get(n, {})) for n in names])
    model = planning_model(machine, backend_name, perf_model)
    backend_kwargs = {"model": model, "noise": noise, "seed": seed} if not be_spec.real else {}
    rounds_load: list[float] = []
    with get_backend(backend_name, machine, **backend_kwargs) as backend:
        use_model = getattr(backend, "use_model", None)
        if callable(use_model):  # plans are lowered through the schedule of the model they were made with
            use_model(model)
        measured = backend.measured
        if repeats is None:
            repeats = 5 if measured or noise > 0 else 1
        results: dict[str, list[Result]] = {}
        bounds: dict[str, float] = {}
        lp_bounds: dict[str, float] = {}
        loaded = []
        bar = progress_bar(console=console, enabled=progress)
        with bar:
            t_load = bar.add_task("loading graphs", total=len(graphs))
            for spec in graphs:
                if be_spec.runs == ("onnx",):  # the graph ONNX Runtime runs (a PyTorch model exported first)
                    from opsched.specs import load_onnx_graph

                    graph = load_onnx_graph(spec, batch=batch, width=width, seed=seed)
                else:
                    graph = load_graph(spec, batch=batch, width=width, seed=seed)
                if measured and graph.source is None:
                    raise OpschedError(f"compare: graph {spec!r} has no executable source; synthetic and JSON "
                                       "graphs run only on --backend sim")
                if measured and _importer(graph) not in be_spec.runs:
                    kind = _WORDS[_importer(graph)]
                    raise OpschedError(f"compare: graph {spec!r} is a {kind} model; --backend {backend_name} runs "
                                       f"{' and '.join(_WORDS.get(r, r) for r in be_spec.runs)} models (use "
                                       f"--backend {_backend_for(_importer(graph))})")
                cached_fingerprint(graph)  # hashed once here, not inside the first policy's decision time
                loaded.append((spec, graph))
                bounds[spec] = float(lower_bound(graph, machine, model))
                lp_bounds[spec] = float(allocation_lp_bound(graph, machine, model))
                bar.advance(t_load)
            run_dir = next_run_dir(out, "compare")  # only once every graph loaded: no empty folders
            atomic_write_text(run_dir / "command.txt", command + "\n")
            t_plan = bar.add_task("planning", total=len(graphs) * len(policies))
            for spec, graph in loaded:
                results[spec] = []
                for pol in policies:
                    bar.update(t_plan, description=f"planning {spec}: {pol.name}")
                    plan, dt = timed_plan(pol, graph, machine, model)
                    plan.save(run_dir / "plans" / f"{_safe(spec)}__{_safe(pol.name)}.json")
                    results[spec].append(Result(spec, pol.name, len(graph.ops), dt, plan=plan,
                                                plan_meta=dict(plan.meta)))
                    bar.advance(t_plan)
            t_run = bar.add_task(f"running on {backend_name}",
                                 total=len(graphs) * len(policies) * (repeats + (warmup if measured else 0)))
            done = 0
            for spec, graph in loaded:
                rows = results[spec]
                traces: dict[str, list[Any]] = {r.policy: [] for r in rows}

                def run_once(r: Result, graph: Any = graph, traces: dict = traces) -> float:
                    trace = backend.run(graph, r.plan)
                    traces[r.policy].append(trace)
                    return _time_of(trace, measured)

                def step(i: int, total: int, spec: str = spec, before: int = done) -> None:
                    bar.update(t_run, completed=before + i, description=f"running {spec}")

                configs = {r.policy: (lambda r=r: run_once(r)) for r in rows}
                t = interleave(configs, warmup if measured else 0, repeats, on_call=step,
                               pids=backend.worker_pids() if isinstance(backend, WorkerProcesses) else ())
                done += len(rows) * (repeats + (warmup if measured else 0))
                for r in rows:
                    r.times = t.samples[r.policy]
                    timed = traces[r.policy][len(traces[r.policy]) - repeats:]  # the timed runs, not the warm-up
                    r.trace = timed[int(np.argsort(r.times)[len(r.times) // 2])]
                if measured:
                    rounds_load += t.others_cores
            plots = _gantt_rows(results, gantt)
            if plots:
                t_plot = bar.add_task("Gantt charts", total=len(plots))
                for r in plots:
                    graph = dict(loaded)[r.graph]
                    r.trace.plot(run_dir / "gantt" / f"{_safe(r.graph)}__{_safe(r.policy)}.png", graph,
                                 title=f"{r.graph} / {r.policy} on {machine.name} ({backend_name}): "
                                       f"{r.median * 1e3:.3g} ms")
                    bar.advance(t_plot)
    rows = _rows(results, bounds, backend_name, machine.name, repeats, lp_bounds)
    timings = Timings({}, rounds_load) if rounds_load else None
    load = timings.load_record() if timings is not None else None
    _write(run_dir, rows, results, dict(graphs=graphs, machine=machine.to_dict(), backend=backend_name,
                                       policies=names, batch=batch, width=width, repeats=repeats,
                                       warmup=warmup if measured else 0, seed=seed, noise=noise,
                                       perf_model=describe(model), perf_model_choice=perf_model, load=load,
                                       command=command, python=platform.python_version()))
    _print_tables(console, rows, results, machine.name, backend_name, measured, len(machine.gpus))
    console.print(f"policies planned with the {describe(model)} performance model (--perf-model {perf_model})")
    if timings is not None and timings.warning():
        console.print(f"[bold yellow]warning:[/bold yellow] {timings.warning()}")
    console.print(f"results in [bold]{run_dir}[/bold]")
    return run_dir, rows


#: ``--gantt`` choices: none, the fastest plan per graph and sequential's, or every plan.
GANTT = ("none", "best", "all")


def _gantt_rows(results: dict[str, list[Result]], which: str) -> list[Result]:
    """The results whose Gantt charts are drawn: ``best`` = per graph the fastest
    plan (and sequential, to compare with), ``all`` = every one."""
    if which == "none":
        return []
    if which == "all":
        return [r for rs in results.values() for r in rs]
    out = []
    for rs in results.values():
        best = min(rs, key=lambda r: r.median)
        out += [r for r in rs if r is best or (r.policy == "sequential" and r is not best)]
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _rows(results: dict[str, list[Result]], bounds: dict[str, float], backend: str, machine: str,
          repeats: int, lp_bounds: dict[str, float] | None = None) -> list[dict[str, Any]]:
    rows = []
    for spec, rs in results.items():
        seq = next(r for r in rs if r.policy == "sequential").median
        lp = (lp_bounds or {}).get(spec, float("nan"))
        proven = [float(r.plan_meta["lower_bound_s"]) for r in rs if "lower_bound_s" in r.plan_meta]
        tight = max([bounds[spec], *(x for x in (lp, *proven) if math.isfinite(x))])
        best = min(r.median for r in rs)
        for r in rs:
            t = np.asarray(r.times)
            rows.append({
                "graph": spec, "policy": r.policy, "backend": backend, "machine": machine, "n_ops": r.n_ops,
                "makespan_s": r.median, "min_s": float(t.min()), "max_s": float(t.max()),
                "iqr_s": float(np.percentile(t, 75) - np.percentile(t, 25)), "repeats": repeats,
                "speedup": seq / r.median if r.median > 0 else float("nan"),
                "lb_ratio": r.median / bounds[spec] if bounds[spec] > 0 else float("nan"),
                "decision_s": r.decision_s, "lower_bound_s": bounds[spec],
                "lp_bound_s": lp, "tight_lb_ratio": _ratio(r.median, tight), "best_known_s": best,
                "best_known_ratio": _ratio(r.median, best),
            })
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        rows.append({
            "graph": "geomean", "policy": p, "backend": backend, "machine": machine, "n_ops": None,
            "makespan_s": None, "min_s": None, "max_s": None, "iqr_s": None, "repeats": repeats,
            "speedup": _geomean([r["speedup"] for r in mine]), "lb_ratio": _geomean([r["lb_ratio"] for r in mine]),
            "decision_s": _geomean([r["decision_s"] for r in mine]), "lower_bound_s": None,
            "lp_bound_s": None, "tight_lb_ratio": _geomean([r["tight_lb_ratio"] for r in mine]),
            "best_known_s": None, "best_known_ratio": _geomean([r["best_known_ratio"] for r in mine]),
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
                  machine: str, backend: str, measured: bool, gpus: int = 0) -> None:
    for spec in results:
        mine = [r for r in rows if r["graph"] == spec]
        t = Table(title=f"{spec} on {machine} ({backend}, {mine[0]['n_ops']} ops)",
                  caption=("spread: half the interquartile range of the repeats" if mine[0]["repeats"] > 1
                           else "spread: - (one simulated run is exact; --noise and --repeats add spread)"))
        for col in ("policy", "makespan ms" + (" (median)" if measured else ""), "spread", "speedup",
                    "/ lower bound", "/ tight bound", "/ best", "decision ms"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        best = min(r["makespan_s"] for r in mine)
        for r in mine:
            spread = f"±{100 * r['iqr_s'] / r['makespan_s'] / 2:.1f}%" if r["repeats"] > 1 else "-"
            style = "bold green" if r["makespan_s"] == best else None
            t.add_row(r["policy"], f"{r['makespan_s'] * 1e3:.4g}", spread, f"{r['speedup']:.2f}x",
                      f"{r['lb_ratio']:.2f}", f"{r['tight_lb_ratio']:.2f}", f"{r['best_known_ratio']:.2f}",
                      f"{r['decision_s'] * 1e3:.3g}", style=style)
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
    if "maestro" in policies and not gpus:
        console.print("maestro places layers across GPUs (NN Maestro); on a machine without GPUs it runs "
                      "every op in order on the CPU, like sequential")


@app.command("compare")
def compare_cmd(
    ctx: typer.Context,
    model: str = typer.Option("zoo:inception,zoo:randwire", "--model", "-m",
                              help="Comma-separated networks or graphs: zoo:NAME[@BxW], keras:NAME, "
                                   "synthetic:FAMILY[:n=N], FAMILY:N:SEED, graph .json files, module.py:factory."),
    machine: str = typer.Option("local", "--machine", help="local, a preset (knl-68, xeon-8180-2s, dgx1-4v100, "
                                "2x2080ti, 4xa6000), a machine YAML, or cpu:CORES:GFLOPS:GBS[:SOCKETS]."),
    backend: str = typer.Option("sim", "--backend", help="Where plans run: " + help_text() + "."),
    policies: str = typer.Option("all", "--policies", "-p",
                                 help="Comma-separated policy names; 'all' = every heuristic and the shipped "
                                      "learned policy; 'search' or an exported policy path may be added."),
    batch: int = typer.Option(1, "--batch", "-b", help="Batch size of the zoo models."),
    width: float = typer.Option(1.0, "--width", help="Width multiplier of the zoo models."),
    repeats: int | None = typer.Option(None, "--repeats", "-r",
                                       help="Timed runs per policy (default 5 on real backends, 1 on sim)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed runs per policy first (real backends)."),
    out: Path = typer.Option(Path("runs"), "--out", help="Parent folder of the compare_<N> run folder."),
    seed: int = typer.Option(0, "--seed", help="Seed for graphs, random plans, search and sim noise."),
    noise: float = typer.Option(0.0, "--noise", help="Simulator measurement noise (relative std)."),
    search_trials: int = typer.Option(100, "--search-trials", help="Trial budget of the 'search' policy (>= 1)."),
    ceiling_s: float = typer.Option(0.0, "--ceiling-s", help="Also run CP-SAT (the 'cpsat' policy) this many "
                                    "seconds per graph: its plan competes and its proven bound tightens "
                                    "'/ tight bound' (0: off; needs OR-Tools)."),
    gantt: str = typer.Option("best", "--gantt", help="Gantt charts: best (per graph the fastest plan and "
                              "sequential), all, or none."),
    mode: str = typer.Option("infer", "--mode", help="infer (the networks' inference graphs) or train (their "
                             "training steps: forward, loss, backward and the optimizer update as one graph; "
                             "the same as naming them train:SPEC)."),
    optimizer: str = typer.Option("sgd", "--optimizer", help="Train mode: sgd, adam or adamw."),
    perf_model: str = typer.Option("auto", "--perf-model",
                                   help="Planning model: auto (this machine's profiles plus the runtime model on "
                                        "real backends, analytic on sim), analytic, or fitted."),
    progress: bool | None = progress_option(),
) -> None:
    """Compare scheduling policies on graphs: makespan, speedup, distance to the lower bound."""
    params = {k: v for k, v in ctx.params.items()}
    specs = list(dict.fromkeys(g.strip() for g in model.split(",") if g.strip()))
    if not specs:
        raise OpschedError("compare: --model names no graph")
    if mode not in ("infer", "train"):
        raise OpschedError(f"compare: --mode must be infer or train, got {mode!r}")
    if mode == "train":
        suffix = "" if optimizer == "sgd" else f":{optimizer}"
        specs = [s if s.startswith("train:") else f"train:{s}{suffix}" for s in specs]
    run_compare(specs, machine, backend, policies, batch=batch, width=width, repeats=repeats, warmup=warmup,
                out=out, seed=seed, noise=noise, search_trials=search_trials, gantt=gantt, perf_model=perf_model,
                command=command_line(params), progress=want_progress(progress), console=console_for(),
                ceiling_s=ceiling_s)
