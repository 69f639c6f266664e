"""Run set-up work on a thread that ends when the work does, so its OpenMP threads end with it.

GNU OpenMP (the runtime torch's CPU wheels use) keeps a pool of worker threads for every thread
that ever ran a parallel loop, for as long as that thread lives, and it counts every pool's
threads. Once they outnumber the cores, each worker stops spinning between parallel loops and
sleeps at once, so every loop of a step starts by waking it: a server that loaded its weights on
the main thread and stepped on an engine thread paid that wake-up in every loop of every step.
Loading on a passing thread leaves no pool behind, so the thread that steps is the only one with
a pool, whichever thread that is.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def on_passing_thread(work: Callable[[], T]) -> T:
    """``work()``, run on a new thread that has ended (its OpenMP pool freed) by the time this
    returns; its exception, if any, is raised here."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="nb-load") as pool:
        future = pool.submit(work)
    return future.result()
