"""Compile workers that never compete with serving: local processes at the lowest CPU priority.

A re-plan runs beside a server that is answering requests on the same cores. Its workers are
``nb compile``'s local processes (spawned, ending with their parent) that first lower their own
priority to nice 19, so the scheduler gives the server's threads the CPU whenever they want it
and the compile takes only what is idle.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from neuron_buckets.compile.executor import PieceExecutor
from neuron_buckets.compile.local_executor import LocalExecutor
from neuron_buckets.compile.piece_queue import PieceQueue
from neuron_buckets.compile.worker import watch_parent

LOWEST_PRIORITY = 19


def lowest_priority() -> None:
    """Worker initializer: nice 19 (the lowest), then end with the parent as every worker does."""
    os.nice(LOWEST_PRIORITY - os.nice(0))
    watch_parent()


class BackgroundExecutor(LocalExecutor):
    initializer = staticmethod(lowest_priority)


class BackgroundPieceQueue(PieceQueue):
    """The piece queue on ``BackgroundExecutor`` workers, whatever ``compile.executor`` says."""

    @contextmanager
    def executor(self, jobs: int | None = None) -> Iterator[PieceExecutor]:
        executor = BackgroundExecutor(jobs or self.config.compile.jobs)
        try:
            yield executor
        finally:
            executor.close()
