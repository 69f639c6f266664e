"""Worker processes on this machine: ``nb compile``'s default executor.

Workers are spawned (a clean interpreter, no inherited locks or threads), share the machine's
cores evenly, and end with ``nb compile`` even when it is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from functools import partial

from neuron_buckets.compile.executor import Submit
from neuron_buckets.compile.worker import compile_piece, watch_parent


class LocalExecutor:
    on_this_host = True
    run = staticmethod(compile_piece)  # what a worker runs; tests swap in one that stops mid-compile
    initializer = staticmethod(watch_parent)  # what each worker process runs first

    def __init__(self, jobs: int) -> None:
        self.slots = max(jobs, 1)
        self.threads = max(1, (os.cpu_count() or 1) // self.slots)

    @contextmanager
    def pool(self) -> Iterator[Submit]:
        context = mp.get_context("spawn")
        with ProcessPoolExecutor(self.slots, mp_context=context, initializer=self.initializer) as pool:
            yield partial(pool.submit, self.run)

    def died(self, error: BaseException) -> bool:
        return isinstance(error, BrokenProcessPool)  # an OOM kill or a segfault breaks the pool

    def close(self) -> None:
        """Nothing outlives a pool."""
