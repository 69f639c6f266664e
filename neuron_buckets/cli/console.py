"""The command line's two streams and its one way to stop with an error.

Results go to stdout (``out``) so ``--json`` output can be piped; logs, progress and errors go to
stderr (``err``). Every command fails the same way: one ``error:`` line, exit status 2.
"""

from __future__ import annotations

import typer
from rich.console import Console

out = Console()
err = Console(stderr=True)


def fail(message: object, code: int = 2) -> typer.Exit:
    """Print one clear error line and return the exit to raise."""
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def int_list(option: str, text: str) -> list[int]:
    """'128,256,512' -> [128, 256, 512], or a ValueError naming the option and the text."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r}") from None
