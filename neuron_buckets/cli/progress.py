"""A rich progress bar for ``nb compile``: pieces done, running and failed, elapsed time and ETA.

A piece reused from a cache takes no time, so it leaves the bar's total instead of advancing it:
the ETA is then the rate of real compiles alone, not one that reused pieces made look fast.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from neuron_buckets.compile.compiler import Outcome


class CompileProgress:
    """Turns the compiler's events into one bar; a log line per finished or failed piece."""

    def __init__(self, total: int, console: Console) -> None:
        self.console = console
        self.queued = self.failed = self.reused = 0
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]compiling"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reused {task.fields[reused]}  running {task.fields[running]}"),
            TextColumn("failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
        )
        self.total = total
        self.task = self.progress.add_task("compile", total=total, reused=0, running=0, failed=0)

    def __enter__(self) -> CompileProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, et: type | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.progress.__exit__(et, ev, tb)

    def __call__(self, event: str, outcome: Outcome) -> None:
        if event == "queued":
            self.queued += 1
        elif event == "retry":
            self.queued -= 1
            why = f" {outcome.name} ({outcome.error}); compiling it again, attempt {outcome.attempts + 1}"
            self.progress.log(Text.assemble(("retry", "yellow"), why))
        elif event == "damaged":
            self.progress.log(Text.assemble(("damaged", "yellow"), f" {outcome.name}: {outcome.error}"))
        elif event == "done":
            if outcome.cached:
                self.reused += 1
                self.progress.update(self.task, total=self.total - self.reused, reused=self.reused)
                return
            self.queued -= 1
            if outcome.status == "ok":
                took = f" {outcome.name} in {outcome.compile_seconds:.1f} s"
                self.progress.print(Text.assemble(("ok", "green"), took))
            else:
                self.failed += 1
                why = f" {outcome.name}: {outcome.error} (see {outcome.log})"
                self.progress.log(Text.assemble(("failed", "red"), why))
            self.progress.update(self.task, advance=1)
        self.progress.update(self.task, running=self.queued, failed=self.failed)
