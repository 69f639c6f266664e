"""A compile worker whose every piece fails: the failed compile a re-plan must survive.

Swapped in through an executor's ``run`` hook (spawned workers import it by name)."""

from __future__ import annotations

from neuron_buckets.compile.worker import CompileTask

INJECTED = "RuntimeError: injected compile failure"


def fails(task: CompileTask) -> tuple[float, str | None]:
    """``compile_piece``'s result for a piece that failed: (seconds, its traceback)."""
    return 0.0, f"Traceback (most recent call last):\n  piece {task.shape.name}\n{INJECTED}\n"
