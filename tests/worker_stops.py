"""Compile workers that stop at a fixed point of the compile: the graph built, not yet published.

Tests of a worker that dies or is killed mid-compile swap one in through an executor's ``run``
hook, instead of killing a process found by its title after a sleep: that raced the compile (a
fast machine had finished it, a slow one not started it) and could hit the wrong process. A file
beside the store (``stopped``) says that a worker got there.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from neuron_buckets.compile.worker import CompileTask, compile_piece


def stopped(store: str | Path) -> Path:
    """The file a stopping worker of a compile into ``store`` (a local path) creates."""
    return Path(store).parent / "worker-stopped"


def first_dies(task: CompileTask) -> tuple[float, str | None]:
    """``compile_piece``, but the first worker to get there exits at once (as an OOM kill would):
    with ``compile.retries`` its piece compiles again, without it the piece has failed."""

    def die() -> None:
        try:
            os.close(os.open(stopped(task.store), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        os._exit(1)

    return compile_piece(task, before_publish=die)


def dies_on(name: str, task: CompileTask) -> tuple[float, str | None]:
    """``compile_piece``, but the worker compiling piece ``name`` exits before publishing it, every
    time (as an OOM kill would); the other pieces compile as usual."""

    def die() -> None:
        os._exit(1)

    return compile_piece(task, before_publish=die if task.shape.name == name else None)


def hangs(task: CompileTask) -> tuple[float, str | None]:
    """``compile_piece``, but the worker stays there until it is killed."""

    def hang() -> None:
        stopped(task.store).touch()
        threading.Event().wait()

    return compile_piece(task, before_publish=hang)
