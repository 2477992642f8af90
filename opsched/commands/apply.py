"""``opsched apply``: plan a model with a policy and run it on the real PyTorch CPU runtime.

Imports the model (``--model zoo:NAME`` or ``path/to/module.py:factory``),
plans it with the policy (default: the shipped pretrained one) using this
machine's cached profiles (the fitted model) or the analytic model, checks
that the scheduled outputs equal eager execution, and times eager,
``critical-path-first`` and the policy: ``--warmup`` untimed runs each, then
``--repeats`` rounds that visit the three round-robin, starting one further
along each round, so drift on a shared machine hits them alike; medians.

``--save-plan plan.json`` keeps the policy's Plan; ``--plan plan.json`` runs
a saved Plan instead of planning (no policy needed).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opsched.cli import app
from opsched.errors import OpschedError

PERF_MODELS = ("auto", "analytic", "fitted")


def _perf_model(choice: str, machine: Any) -> tuple[Any, str]:
    from opsched.backends.perfmodel import default_model

    if choice not in PERF_MODELS:
        raise OpschedError(f"apply: --perf-model must be one of {', '.join(PERF_MODELS)}, got {choice!r}")
    if choice == "analytic":
        return default_model(), "analytic"
    from opsched.backends.fitted import FittedModel, fitted_or_analytic

    model = FittedModel.from_cache(machine) if choice == "fitted" else fitted_or_analytic(machine)
    return model, ("fitted (cached profiles)" if isinstance(model, FittedModel) else "analytic (no cached profile)")


def _summary(plan: Any) -> str:
    """Threads used and how many ops may co-run, in a few words."""
    threads = sorted({a.threads for a in plan.assignments.values()})
    waits = sum(1 for a in plan.assignments.values() if a.after)
    return f"threads {'/'.join(map(str, threads))}" + (f", {waits} holds" if waits else "")


def run_apply(model_spec: str, policy: str | None = None, *, batch: int = 1, width: float = 1.0,
              repeats: int = 10, warmup: int = 2, plan_file: Path | None = None, save_plan: Path | None = None,
              perf_model: str = "auto", console: Console | None = None, progress: bool = True) -> dict[str, Any]:
    """Everything ``opsched apply`` does, returning the figures (see the module docstring)."""
    import torch

    from opsched.backends.torch_cpu import TorchCPUBackend
    from opsched.importers.torch_fx import from_torch
    from opsched.machine import get_machine
    from opsched.models import load_model
    from opsched.plan import Plan
    from opsched.policies import get_policy
    from opsched.scheduled import cpu_only, outputs_close, resolve_policy

    console = console or Console(stderr=True)
    if batch < 1 or width <= 0 or repeats < 1 or warmup < 0:
        raise OpschedError("apply: --batch and --repeats must be >= 1, --width > 0, --warmup >= 0")
    machine = cpu_only(get_machine("local"))
    module, inputs = load_model(model_spec, batch, width)
    graph = from_torch(module, inputs, name=model_spec.removeprefix("zoo:"))
    model, model_name = _perf_model(perf_model, machine)

    if plan_file is not None:
        plan = Plan.load(plan_file)
        plan.validate(graph, machine)
        label, plan_s = f"saved plan ({plan.policy or 'unnamed'})", None
        policy_desc = str(plan_file)
    else:
        pol = resolve_policy(policy)
        t0 = time.perf_counter()
        plan = pol.plan(graph, machine, model)
        plan_s = time.perf_counter() - t0
        plan.validate(graph, machine)
        label = f"policy ({pol.name})"
        policy_desc = str(getattr(pol, "folder", pol.name))
    if save_plan is not None:
        plan.save(save_plan)
    cpf = get_policy("critical-path-first").plan(graph, machine, model)

    backend = TorchCPUBackend(machine)
    try:
        with torch.no_grad():
            reference = module(*inputs)
        configs: dict[str, Any] = {
            "eager": lambda: module(*inputs),
            "critical-path-first": lambda: backend.execute(graph, cpf, *inputs),
            label: lambda: backend.execute(graph, plan, *inputs),
        }
        plans = {"critical-path-first": cpf, label: plan}
        same = {name: outputs_close(backend.execute(graph, p, *inputs), reference) for name, p in plans.items()}
        same["eager"] = True
        times: dict[str, list[float]] = {k: [] for k in configs}
        names = list(configs)
        total = len(names) * (warmup + repeats)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, disable=not progress, transient=True) as bar, torch.no_grad():
            task = bar.add_task(f"timing {graph.name}", total=total)
            for name in names:
                for _ in range(warmup):
                    configs[name]()
                    bar.advance(task)
            for k in range(repeats):
                for j in range(len(names)):
                    name = names[(j + k) % len(names)]
                    t0 = time.perf_counter()
                    configs[name]()
                    times[name].append(time.perf_counter() - t0)
                    bar.advance(task)
    finally:
        backend.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name in names:
        rows.append({
            "config": name, "median_s": med[name], "min_s": min(times[name]), "max_s": max(times[name]),
            "speedup_vs_eager": med["eager"] / med[name], "outputs_equal_eager": bool(same[name]),
            "plan": _summary(plans[name]) if name in plans else f"torch default ({torch.get_num_threads()} threads)",
        })
    return {
        "model": model_spec, "batch": batch, "width": width, "graph": graph.name, "n_ops": len(graph.ops),
        "machine": machine.name, "cores": machine.cpu.cores, "perf_model": model_name, "policy": policy_desc,
        "plan_s": plan_s, "coarsened": bool(plan.meta.get("coarsened", False)), "repeats": repeats,
        "warmup": warmup, "rows": rows,
        "policy_vs_cpf": med["critical-path-first"] / med[label],
    }


def print_result(result: dict[str, Any], console: Console) -> None:
    t = Table(title=f"{result['model']} (batch {result['batch']}, {result['n_ops']} ops) on {result['machine']} "
                    f"({result['cores']} cores): median of {result['repeats']} interleaved runs")
    t.add_column("configuration", no_wrap=True)
    t.add_column("plan")
    t.add_column("ms / run", justify="right", no_wrap=True)
    t.add_column("min-max", justify="right")
    t.add_column("speed-up", justify="right", no_wrap=True)
    t.add_column("= eager", justify="center", no_wrap=True)
    for r in result["rows"]:
        ok = "[green]yes[/green]" if r["outputs_equal_eager"] else "[bold red]NO[/bold red]"
        t.add_row(r["config"], r["plan"], f"{r['median_s'] * 1e3:.2f}",
                  f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}", f"{r['speedup_vs_eager']:.2f}x", ok)
    console.print(t)
    planned = (f"planned in {result['plan_s'] * 1e3:.1f} ms" if result["plan_s"] is not None else "saved plan")
    console.print(f"policy: {result['policy']} ({planned}{', coarsened' if result['coarsened'] else ''}); "
                  f"performance model: {result['perf_model']}; policy vs critical-path-first: "
                  f"{result['policy_vs_cpf']:.2f}x")


@app.command("apply")
def apply_cmd(
    model: str = typer.Option(..., "--model", "-m", help="zoo:NAME, or path/to/module.py:factory (factory(batch) "
                              "returns (nn.Module, example_inputs))."),
    policy: str = typer.Option(None, "--policy", "-p", help="Exported policy folder (runs/<run>/policy), or a "
                               "heuristic's name. Default: the shipped pretrained policy."),
    batch: int = typer.Option(1, "--batch", "-b", help="Batch size."),
    width: float = typer.Option(1.0, "--width", help="Width multiplier of zoo models."),
    repeats: int = typer.Option(10, "--repeats", "-r", help="Timed rounds (each runs every configuration once)."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed runs per configuration first."),
    save_plan: Path = typer.Option(None, "--save-plan", help="Write the policy's Plan to this JSON file."),
    plan: Path = typer.Option(None, "--plan", help="Run this saved Plan instead of planning (no policy needed)."),
    perf_model: str = typer.Option("auto", "--perf-model", help="auto (fitted if this machine has cached "
                                   "profiles, else analytic), analytic, or fitted."),
    json_out: Path = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
) -> None:
    """Schedule a model with a learned policy and run it on this CPU: eager vs critical-path-first vs the policy."""
    console = Console()
    result = run_apply(model, policy, batch=batch, width=width, repeats=repeats, warmup=warmup, plan_file=plan,
                       save_plan=save_plan, perf_model=perf_model, console=Console(stderr=True))
    print_result(result, console)
    if save_plan is not None:
        console.print(f"plan saved to {save_plan} (run it again with --plan {save_plan})")
    if json_out is not None:
        from opsched.io import atomic_write_text

        atomic_write_text(json_out, json.dumps(result, indent=1) + "\n")
    bad = [r["config"] for r in result["rows"] if not r["outputs_equal_eager"]]
    if bad:
        raise OpschedError(f"apply: the outputs of {', '.join(bad)} differ from eager execution")
