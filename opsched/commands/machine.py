"""``opsched machine``: show this machine (probed) or a preset, or print a
commented YAML template of it (``--yaml``) to edit into your own machine.

The template explains every field with its unit (``gflops`` is per core on a
CPU and per device on a GPU) and loads back unchanged; a bad field in a
machine file is one ``error:`` line naming the file, the device and the field.
"""

from __future__ import annotations

import typer
from rich.table import Table

from opsched.commands.app import app, console_for
from opsched.machine import MACHINE_SPECS, PRESETS


@app.command("machine")
def machine_cmd(
    name: str = typer.Argument("local", help=f"The machine: {MACHINE_SPECS}; or random:SEED (a draw of the "
                               "randomized family policies train on)."),
    list_presets: bool = typer.Option(False, "--list", help="List the presets instead."),
    yaml_out: bool = typer.Option(False, "--yaml", help="Print it as commented YAML: a template for your own "
                                  "machine (edit it, then pass --machine FILE.yaml)."),
) -> None:
    """Describe a machine: its devices, cores, speeds (GFLOP/s per CPU core, per GPU) and links."""
    console = console_for()
    if list_presets:
        t = Table(title="machine presets")
        for col in ("name", "devices", "description"):
            t.add_column(col)
        for m in PRESETS.values():
            t.add_row(m.name, ", ".join(f"{d.id}({d.cores})" for d in m.devices), m.description)
        console.print(t)
        return
    from opsched.specs import load_machine

    m = load_machine(name)
    if yaml_out:
        typer.echo(m.to_yaml(), nl=False)
        return
    t = Table(title=f"{m.name}: {m.description}")
    for col in ("device", "kind", "name", "cores/streams", "sockets", "SMT", "GFLOP/s (per core / GPU)", "mem GB/s",
                "memory GB"):
        t.add_column(col)
    for d in m.devices:
        t.add_row(d.id, d.kind, d.name, str(d.cores), str(d.sockets), str(d.smt), f"{d.gflops:g}",
                  f"{d.mem_bandwidth_gbs:g}", f"{d.memory_gb:g}")
    console.print(t)
    if m.links:
        lt = Table(title="links")
        for col in ("between", "GB/s", "latency µs"):
            lt.add_column(col)
        for link in m.links:
            lt.add_row(f"{link.a} <-> {link.b}", f"{link.bandwidth_gbs:g}", f"{link.latency_us:g}")
        console.print(lt)
    console.print(f"fingerprint: {m.fingerprint()}   thread levels: {m.cpu.thread_levels()}")
    if m.source:
        console.print(f"[dim]source: {m.source}[/dim]")
