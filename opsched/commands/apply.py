"""``opsched apply``: plan a model with a policy and run it on a real CPU runtime.

Imports the model (``--model zoo:NAME``, ``keras:NAME`` or
``path/to/module.py:factory``; see :mod:`opsched.models`), plans it with the
policy (default: the shipped pretrained one) using this machine's cached
profiles (the fitted model) or the analytic model, checks that the scheduled
outputs equal eager execution, and times every configuration: ``--warmup``
untimed runs each, then ``--repeats`` rounds that visit them round-robin,
starting one further along each round, so drift on a shared machine hits them
alike; medians.

Runtimes (``--backend``): ``torch-cpu`` runs PyTorch modules with
:class:`~opsched.backends.torch_cpu.TorchCPUBackend`; the rows are eager
PyTorch (the reference of the speed-up column), critical-path-first and the
policy.  ``tf`` runs Keras models with
:class:`~opsched.backends.tf_cpu.TFBackend` (one TensorFlow worker process
per thread setting; a plan becomes thread-pool sizes plus control
dependencies, see that module); the rows are ``tf-default`` (TensorFlow's own
thread pools, placement and order: the reference), ``tf-recommended`` (inter =
sockets, intra = cores per socket), critical-path-first and the policy, each
timed inside its worker around the session call; the outputs of every row are
checked against eager Keras, ``model(x, training=False)``.  ``auto`` (the
default) picks the runtime of the model's framework.

``--save-plan plan.json`` keeps the policy's Plan; ``--plan plan.json`` runs
a saved Plan instead of planning (no policy needed).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opsched.cli import app
from opsched.errors import OpschedError

PERF_MODELS = ("auto", "analytic", "fitted")
BACKENDS = ("auto", "torch-cpu", "tf")
#: TensorFlow's graph runtime (Grappler's remapper fuses ops, oneDNN picks other
#: kernels) sums in another order than eager Keras: float32 round-off, not errors.
TF_RTOL, TF_ATOL = 1e-3, 1e-5

#: A configuration to time: one run, returning its wall seconds; and its plan in words.
Config = tuple[Callable[[], float], str]


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


def resolve_backend(choice: str, framework: str, spec: str) -> str:
    """The runtime ``--backend choice`` means for a model of ``framework`` ("torch" or "keras")."""
    if choice not in BACKENDS:
        raise OpschedError(f"apply: --backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "tf" if framework == "keras" else "torch-cpu"
    if choice == "tf" and framework != "keras":
        raise OpschedError(f"apply: --backend tf runs Keras models, but {spec!r} is a PyTorch model; "
                           "use --backend torch-cpu (or auto)")
    if choice == "torch-cpu" and framework != "torch":
        raise OpschedError(f"apply: --backend torch-cpu runs PyTorch modules, but {spec!r} is a Keras model; "
                           "use --backend tf (or auto)")
    return choice


def _torch_configs(loaded: Any, graph: Any, machine: Any, plans: dict[str, Any],
                   stack: contextlib.ExitStack) -> tuple[dict[str, Config], dict[str, bool]]:
    """eager PyTorch + each plan on TorchCPUBackend; and whether each one's outputs equal eager's."""
    import torch

    from opsched.backends.torch_cpu import TorchCPUBackend
    from opsched.scheduled import outputs_close

    module, inputs = loaded.model, loaded.inputs
    backend = stack.enter_context(TorchCPUBackend(machine))

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def once() -> float:
            with torch.no_grad():
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0
        return once

    with torch.no_grad():
        reference = module(*inputs)
        same = {name: outputs_close(backend.execute(graph, p, *inputs), reference) for name, p in plans.items()}
    configs: dict[str, Config] = {"eager": (timed(lambda: module(*inputs)),
                                            f"torch default ({torch.get_num_threads()} threads)")}
    for name, p in plans.items():
        configs[name] = (timed(lambda p=p: backend.execute(graph, p, *inputs)), _summary(p))
    return configs, {"eager": True, **same}


def _keras_eager(model: Any, feeds: list[Any]) -> list[Any]:
    """The reference outputs: the Keras model called eagerly, flattened as the importer fetches them."""
    import numpy as np
    import tensorflow as tf

    out = model(feeds[0] if len(feeds) == 1 else list(feeds), training=False)
    return [np.asarray(t) for t in tf.nest.flatten(out)]


def _arrays_close(got: list[Any], want: list[Any]) -> bool:
    import numpy as np

    return len(got) == len(want) and all(
        g.shape == w.shape and g.dtype == w.dtype and bool(np.allclose(g, w, rtol=TF_RTOL, atol=TF_ATOL))
        for g, w in zip(got, want))


def _tf_configs(loaded: Any, graph: Any, machine: Any, plans: dict[str, Any], stack: contextlib.ExitStack,
                backend: Any = None) -> tuple[dict[str, Config], dict[str, bool]]:
    """tf-default, tf-recommended + each plan on TFBackend; and whether each one's outputs equal eager Keras's."""
    from opsched.backends.tf_cpu import TFBackend, tf_default, tf_recommended

    be = backend if backend is not None else stack.enter_context(TFBackend(machine))
    feeds = list(loaded.inputs) if loaded.inputs is not None else graph.source.random_inputs(0)
    reference = _keras_eager(loaded.model, feeds)
    configs: dict[str, Config] = {}
    same: dict[str, bool] = {}
    for name, st in (("tf-default", tf_default()), ("tf-recommended", tf_recommended(machine))):
        desc = f"{'TF picks: ' if st.inter == st.intra == 0 else ''}inter={st.inter}, intra={st.intra}"
        configs[name] = (lambda st=st: be.measure(graph, st, repeats=1, warmup=0, inputs=feeds)[0], desc)
        same[name] = _arrays_close(be.execute(graph, None, feeds, settings=st), reference)
    for name, p in plans.items():
        st = be.settings_for(graph, p)
        configs[name] = (lambda p=p: be.time_plan(graph, p, repeats=1, warmup=0, inputs=feeds)[0],
                         f"{_summary(p)} -> inter={st.inter}, intra={st.intra}")
        same[name] = _arrays_close(be.execute(graph, p, feeds), reference)
    return configs, same


def _interleave(configs: dict[str, Config], warmup: int, repeats: int, label: str, console: Console,
                progress: bool) -> dict[str, list[float]]:
    """``warmup`` untimed runs each, then ``repeats`` rounds round-robin, rotated by one each round."""
    names = list(configs)
    times: dict[str, list[float]] = {k: [] for k in names}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not progress, transient=True) as bar:
        task = bar.add_task(label, total=len(names) * (warmup + repeats))
        for name in names:
            for _ in range(warmup):
                configs[name][0]()
                bar.advance(task)
        for k in range(repeats):
            for j in range(len(names)):
                name = names[(j + k) % len(names)]
                times[name].append(configs[name][0]())
                bar.advance(task)
    return times


def run_apply(model_spec: str, policy: str | None = None, *, backend: str = "auto", batch: int = 1,
              width: float = 1.0, repeats: int = 10, warmup: int = 2, plan_file: Path | None = None,
              save_plan: Path | None = None, perf_model: str = "auto", console: Console | None = None,
              progress: bool = True, tf_backend: Any = None) -> dict[str, Any]:
    """Everything ``opsched apply`` does, returning the figures (see the module docstring).

    ``tf_backend``: an open :class:`~opsched.backends.tf_cpu.TFBackend` to reuse
    (its worker processes stay up; it is not closed here, and its machine is the
    one planned for); by default a fresh one on this machine's CPU is opened and closed.
    """
    from opsched.machine import get_machine
    from opsched.models import import_graph, load_any
    from opsched.plan import Plan
    from opsched.policies import get_policy
    from opsched.scheduled import cpu_only, resolve_policy

    console = console or Console(stderr=True)
    if batch < 1 or width <= 0 or repeats < 1 or warmup < 0:
        raise OpschedError("apply: --batch and --repeats must be >= 1, --width > 0, --warmup >= 0")
    if backend not in BACKENDS:
        raise OpschedError(f"apply: --backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    loaded = load_any(model_spec, batch, width)
    runtime = resolve_backend(backend, loaded.framework, model_spec)
    machine = tf_backend.machine if (runtime == "tf" and tf_backend is not None) else cpu_only(get_machine("local"))
    graph = import_graph(loaded, batch)
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
    plans = {"critical-path-first": get_policy("critical-path-first").plan(graph, machine, model), label: plan}

    with contextlib.ExitStack() as stack:
        if runtime == "tf":
            configs, same = _tf_configs(loaded, graph, machine, plans, stack, tf_backend)
        else:
            configs, same = _torch_configs(loaded, graph, machine, plans, stack)
        times = _interleave(configs, warmup, repeats, f"timing {graph.name} ({runtime})", console, progress)

    reference = next(iter(configs))  # eager (torch) or tf-default (tf)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{
        "config": name, "median_s": med[name], "min_s": min(times[name]), "max_s": max(times[name]),
        "speedup": med[reference] / med[name], "outputs_equal_eager": bool(same[name]), "plan": configs[name][1],
    } for name in configs]
    return {
        "model": model_spec, "framework": loaded.framework, "backend": runtime, "reference": reference,
        "batch": batch, "width": width, "graph": graph.name, "n_ops": len(graph.ops),
        "machine": machine.name, "cores": machine.cpu.cores, "perf_model": model_name, "policy": policy_desc,
        "plan_s": plan_s, "coarsened": bool(plan.meta.get("coarsened", False)), "repeats": repeats,
        "warmup": warmup, "rows": rows,
        "policy_vs_cpf": med["critical-path-first"] / med[label],
    }


def print_result(result: dict[str, Any], console: Console) -> None:
    t = Table(title=f"{result['model']} (batch {result['batch']}, {result['n_ops']} ops) on {result['machine']} "
                    f"({result['cores']} cores, {result['backend']}): median of {result['repeats']} interleaved runs")
    t.add_column("configuration", no_wrap=True)
    t.add_column("plan")
    t.add_column("ms / run", justify="right", no_wrap=True)
    t.add_column("min-max", justify="right")
    t.add_column(f"speed-up vs {result['reference']}", justify="right")
    t.add_column("= eager", justify="center", no_wrap=True)
    for r in result["rows"]:
        ok = "[green]yes[/green]" if r["outputs_equal_eager"] else "[bold red]NO[/bold red]"
        t.add_row(r["config"], r["plan"], f"{r['median_s'] * 1e3:.2f}",
                  f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}", f"{r['speedup']:.2f}x", ok)
    console.print(t)
    planned = (f"planned in {result['plan_s'] * 1e3:.1f} ms" if result["plan_s"] is not None else "saved plan")
    console.print(f"policy: {result['policy']} ({planned}{', coarsened' if result['coarsened'] else ''}); "
                  f"performance model: {result['perf_model']}; policy vs critical-path-first: "
                  f"{result['policy_vs_cpf']:.2f}x")
    if result["backend"] == "tf":
        console.print("tf: '= eager' compares with eager Keras, model(x); a plan runs with one process-wide "
                      "intra-op pool, its order and co-running as control dependencies (opsched.backends.tf_cpu)")


@app.command("apply")
def apply_cmd(
    model: str = typer.Option(..., "--model", "-m", help="zoo:NAME (PyTorch), keras:NAME[:side=N] (a "
                              "keras.applications model), or path/to/module.py:factory (factory(batch) returns "
                              "(nn.Module, example_inputs) or a built Keras model)."),
    backend: str = typer.Option("auto", "--backend", help="Runtime: auto (torch-cpu for PyTorch models, tf for "
                                "Keras models), torch-cpu, or tf (TensorFlow's CPU runtime; rows tf-default and "
                                "tf-recommended replace eager)."),
    policy: str = typer.Option(None, "--policy", "-p", help="Exported policy folder (runs/<run>/policy), or a "
                               "heuristic's name. Default: the shipped pretrained policy."),
    batch: int = typer.Option(1, "--batch", "-b", help="Batch size."),
    width: float = typer.Option(1.0, "--width", help="Width multiplier of zoo models (alpha of "
                               "Keras models that have one)."),
    repeats: int = typer.Option(10, "--repeats", "-r", help="Timed rounds (each runs every configuration once)."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed runs per configuration first."),
    save_plan: Path = typer.Option(None, "--save-plan", help="Write the policy's Plan to this JSON file."),
    plan: Path = typer.Option(None, "--plan", help="Run this saved Plan instead of planning (no policy needed)."),
    perf_model: str = typer.Option("auto", "--perf-model", help="auto (fitted if this machine has cached "
                                   "profiles, else analytic), analytic, or fitted."),
    json_out: Path = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
) -> None:
    """Schedule a model with a learned policy and run it on this CPU: eager (or TensorFlow's own settings) vs
    critical-path-first vs the policy."""
    console = Console()
    result = run_apply(model, policy, backend=backend, batch=batch, width=width, repeats=repeats, warmup=warmup,
                       plan_file=plan, save_plan=save_plan, perf_model=perf_model, console=Console(stderr=True))
    print_result(result, console)
    if save_plan is not None:
        console.print(f"plan saved to {save_plan} (run it again with --plan {save_plan})")
    if json_out is not None:
        from opsched.io import atomic_write_text

        atomic_write_text(json_out, json.dumps(result, indent=1) + "\n")
    bad = [r["config"] for r in result["rows"] if not r["outputs_equal_eager"]]
    if bad:
        raise OpschedError(f"apply: the outputs of {', '.join(bad)} differ from eager execution")
