"""Where pieces compile: the one interface the compiler drives, whatever runs the workers.

The compiler's loop (queue, progress, retries, ``--fail-fast``, the manifest rewrite after each
piece) is the same for every executor; an executor only says how many pieces run at once, hands
out a pool that turns a ``CompileTask`` into a future, and tells a dead worker from a failure.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Protocol

from neuron_buckets.compile.worker import CompileTask

Submit = Callable[[CompileTask], Future]


class PieceExecutor(Protocol):
    slots: int  # pieces in flight at once
    threads: int  # torch threads each compile may use
    on_this_host: bool  # whether its workers share this machine's disk (and local cache)

    def pool(self) -> AbstractContextManager[Submit]:
        """A fresh pool of workers. After a worker died, the compiler drains the pool and asks
        for a fresh one (a local process pool is broken by the death)."""
        ...

    def died(self, error: BaseException) -> bool:
        """Whether a future's exception means its worker died (the piece may be retried), not
        that the piece failed."""
        ...

    def close(self) -> None:
        ...
