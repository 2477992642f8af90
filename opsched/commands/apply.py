"""``opsched apply``: schedule a model with a policy and time it on this machine's CPU.

Parses the options, calls :func:`opsched.real_apply.run_apply` (which applies
the policy with :func:`opsched.apply` and times it against the framework's
own execution and critical-path-first) and formats the result; the figures
also land in ``<out>/apply_<N>/apply.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from opsched.backends.registry import help_text, names
from opsched.commands.app import app, console_for, progress_option, want_progress
from opsched.commands.flags import parse_bytes
from opsched.errors import OpschedError
from opsched.measured import DEFAULT_TOP
from opsched.progress import progress_bar
from opsched.real_apply import SAME_BAND, ApplyResult, run_apply


def print_result(result: ApplyResult, console: Console) -> None:
    what = "training step, " if result.mode == "train" else ""
    t = Table(title=f"{result.model} ({what}batch {result.batch}, {result.n_ops} ops) on {result.machine} "
                    f"({result.cores} cores, {result.backend}): median of {result.repeats} interleaved runs, each "
                    "after the previous run's threads went quiet")
    t.add_column("configuration", no_wrap=True)
    t.add_column("plan")
    t.add_column("ms / run", justify="right", no_wrap=True)
    t.add_column("quartiles", justify="right", no_wrap=True)
    t.add_column(f"speed-up vs {result.reference}", justify="right")
    t.add_column("per round", justify="center", no_wrap=True)
    t.add_column("= eager", justify="center", no_wrap=True)
    for r in result.rows:
        ok = "[green]yes[/green]" if r.outputs_equal_eager else "[bold red]NO[/bold red]"
        verdict = {"faster": "[green]faster[/green]", "slower": "[red]slower[/red]", "same": "same",
                   "reference": "-"}[r.verdict]
        t.add_row(r.config, r.plan, f"{r.median_s * 1e3:.2f}", f"{r.q1_s * 1e3:.1f}-{r.q3_s * 1e3:.1f}",
                  f"{r.speedup:.2f}x", verdict, ok)
    console.print(t)
    planned = (f"planned in {result.plan_s * 1e3:.1f} ms" if result.plan_s is not None else "saved plan")
    console.print(f"policy: {result.policy} ({planned}{', coarsened' if result.coarsened else ''}); "
                  f"planning model: {result.perf_model}; policy vs critical-path-first: "
                  f"{result.policy_vs_cpf:.2f}x")
    console.print(f"'per round': faster / slower only when the time ratio to {result.reference} is beyond "
                  f"{SAME_BAND:.0%} in at least three rounds of four (its quartiles), else the same speed")
    if result.measured:
        times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(result.measured.items(), key=lambda kv: kv[1]))
        console.print(f"the policy's candidates timed here before choosing: {times}; kept {result.chosen}")
    for key, why in result.fallbacks.items():
        console.print(f"[yellow]{key} runs eagerly: {why}[/yellow]")
    if result.load_warning:
        console.print(f"[bold yellow]warning:[/bold yellow] {result.load_warning}", markup=True)
    if result.note:
        console.print(result.note)


@app.command("apply")
def apply_cmd(
    model: str = typer.Option(..., "--model", "-m", help="The network: zoo:NAME, keras:NAME[:side=N] (a "
                              "keras.applications model), path/to/model.onnx, or path/to/module.py:factory "
                              "(factory(batch) returns (nn.Module, example_inputs) or a built Keras model)."),
    backend: str = typer.Option("auto", "--backend", help="Runtime: auto (ort for PyTorch models that export to "
                                "ONNX with matching outputs, else torch-cpu; tf for Keras models; ort for .onnx "
                                "files), or one of: " + help_text(names(apply=True)) + ". The first row is the "
                                "framework's own run (eager; tf-default; ort-sequential), the reference."),
    policy: str = typer.Option(None, "--policy", "-p", help="Exported policy folder (runs/<run>/policy), or a "
                               "heuristic's name. Default: the shipped pretrained policy."),
    batch: int = typer.Option(1, "--batch", "-b", help="Batch size."),
    width: float = typer.Option(1.0, "--width", help="Width multiplier of zoo models (alpha of "
                                "Keras models that have one)."),
    repeats: int = typer.Option(10, "--repeats", "-r", help="Timed rounds (each runs every configuration once)."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed runs per configuration first."),
    save_plan: Path = typer.Option(None, "--save-plan", help="Write the policy's Plan to this JSON file."),
    plan: Path = typer.Option(None, "--plan", help="Run this saved Plan instead of planning (no policy needed)."),
    measure: int = typer.Option(DEFAULT_TOP, "--measure", min=0, help="How many of the learned policy's best "
                                "candidate plans (by the planning model) are timed on this machine before one is "
                                "kept; 0 trusts the model alone. On --backend ort: the plan is timed against "
                                "ONNX Runtime's one session and the faster kept."),
    mode: str = typer.Option("infer", "--mode", help="infer (the network's inference) or train (its training step: "
                             "forward, loss, backward and the optimizer update as one graph; zoo models use "
                             "their default loss; rows are eager steps at default threads and at 1 thread)."),
    optimizer: str = typer.Option("sgd", "--optimizer", help="Train mode: sgd (lr 0.01, momentum 0.9), adam "
                                  "(lr 1e-3) or adamw (lr 1e-3, weight decay 0.01)."),
    lr: float = typer.Option(None, "--lr", help="Train mode: the optimizer's learning rate (default: as above)."),
    memory_limit: str = typer.Option(None, "--memory-limit", help="Most activation memory a plan may keep alive at "
                                     "once, e.g. 2GB (default: this machine's memory); a plan over it is replaced by "
                                     "one under it, else the model runs eagerly.", show_default=False),
    perf_model: str = typer.Option("auto", "--perf-model", help="Planning model: auto (this machine's profiles "
                                   "plus the runtime model `opsched profile` fitted, if cached; else analytic), "
                                   "analytic, or fitted."),
    out: Path = typer.Option(Path("runs"), "--out", help="Parent folder of the apply_<N> run folder (the "
                             "measurements as JSON)."),
    json_out: Path = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
    progress: bool | None = progress_option(),
) -> None:
    """Schedule a model with a learned policy and run it on this CPU: eager (or TensorFlow's own settings) vs
    critical-path-first vs the policy, outputs checked, medians of interleaved rounds."""
    from opsched.io import atomic_write_text, next_run_dir

    console = console_for()
    with progress_bar(console=console_for(stderr=True), enabled=want_progress(progress), transient=True) as bar:
        task = bar.add_task(f"timing {model}", total=None)

        def on_call(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = run_apply(model, policy, backend=backend, batch=batch, width=width, repeats=repeats, warmup=warmup,
                           plan_file=plan, save_plan=save_plan, perf_model=perf_model, on_call=on_call,
                           measure=measure, mode=mode, optimizer=optimizer, lr=lr,
                           memory_limit=parse_bytes(memory_limit))
    print_result(result, console)
    if save_plan is not None:
        console.print(f"plan saved to {save_plan} (run it again with --plan {save_plan})")
    text = json.dumps(result.to_dict(), indent=1, default=str) + "\n"
    run_dir = next_run_dir(out, "apply")
    atomic_write_text(run_dir / "apply.json", text)
    console.print(f"measurements in [bold]{run_dir / 'apply.json'}[/bold]")
    if json_out is not None:
        atomic_write_text(json_out, text)
    bad = [r.config for r in result.rows if not r.outputs_equal_eager]
    if bad:
        raise OpschedError(f"apply: the outputs of {', '.join(bad)} differ from eager execution")


__all__: list[str] = []
