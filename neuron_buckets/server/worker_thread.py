"""One thread for a route's slow work (tokenizing, embedding), off the event loop and off the engine
thread, one call at a time. It holds a bounded number of calls, running and waiting together, so a
flood of clients gets 429 rather than a queue that grows without limit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from neuron_buckets.server.errors import server_busy

Arg = TypeVar("Arg")
Result = TypeVar("Result")


class WorkerThread:
    def __init__(self, name: str, limit: int) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.limit, self.held = limit, 0

    async def run(self, work: Callable[[Arg], Result], arg: Arg) -> Result:
        """``work(arg)`` on the thread, once it is free; ``ServerBusy`` if it holds ``limit`` calls."""
        if self.held >= self.limit:
            raise server_busy(self.limit)
        self.held += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, work, arg)
        finally:
            self.held -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
