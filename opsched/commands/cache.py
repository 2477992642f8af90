"""``opsched cache``: where opsched keeps profiles, fitted runtime models and exports, and emptying it."""

from __future__ import annotations

import typer

from opsched.commands.app import app, console_for


@app.command("cache")
def cache_cmd(
    path: bool = typer.Option(False, "--path", help="Print only the cache directory (for scripts)."),
    clear: bool = typer.Option(False, "--clear", help="Delete everything opsched cached (profiles, fitted "
                               "runtime models, ONNX exports, imported graphs); other files in the folder stay."),
) -> None:
    """Show the per-user cache opsched plans from: profiles, fitted runtime models, ONNX exports, imported graphs.

    The cache does not depend on the working directory; $OPSCHED_CACHE overrides its place."""
    from opsched import cache

    console = console_for()
    if path:
        console.print(str(cache.root()), soft_wrap=True)
        return
    if clear:
        freed = cache.clear()
        console.print(f"cleared {cache.root()} ({freed / 1e6:.1f} MB freed)", soft_wrap=True)
        return
    where = f"{cache.root()}" + (f" (from ${cache.ENV})" if cache.ENV in __import__("os").environ else "")
    console.print(f"cache: {where}", soft_wrap=True)
    for part, size in cache.usage().items():
        console.print(f"  {part + '/':<10} {size / 1e6:8.1f} MB")


__all__: list[str] = []
