"""The ``nb`` command line: thin typer wrappers over the library, rich output, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from neuron_buckets import __version__
from neuron_buckets.config import ConfigError, load_config
from neuron_buckets.grid import enumerate_grid

app = typer.Typer(
    help="Compile one fixed-shape LLM graph per (batch, seq) bucket over a block-KV cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

ConfigArg = Annotated[
    Path | None, typer.Argument(help="TOML config; default: the embedded default config")
]


def _print_version(value: bool) -> None:
    if value:
        console.print(f"neuron-buckets {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version")
    ] = False,
) -> None:
    """A callback keeps ``nb`` a command group even while it has a single command."""


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear error line and return the exit to raise."""
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def load_or_fail(config: Path | None):
    try:
        return load_config(config)
    except ConfigError as e:
        raise fail(str(e)) from None


@app.command()
def grid(config: ConfigArg = None) -> None:
    """Show the bucket grid a config compiles: one row per graph."""
    cfg = load_or_fail(config)
    table = Table(title=f"bucket grid ({config or 'embedded default'})")
    for col in ("kind", "batch", "seq", "ctx", "tokens per graph"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    buckets = enumerate_grid(cfg)
    for b in buckets:
        table.add_row(b.kind, str(b.batch), str(b.seq), str(b.ctx), str(b.tokens))
    console.print(table)
    console.print(f"{len(buckets)} graphs")
