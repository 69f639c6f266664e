"""The pieces still to compile, handed to an executor: as many at once as it has slots, each
finished one reported, a piece whose worker died queued again.

Executors are local worker processes (``--jobs``) or Ray tasks; the loop is the same for both.
A failing piece is finished with its error (its buckets fail) and the rest go on, unless
``--fail-fast``, which starts nothing more. A worker that dies ends its pool (a local one is broken
by it): the pieces then in flight are queued again and a fresh pool compiles the rest; a piece is
retried ``compile.retries`` times, then finished as failed with the reason.
"""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass

from neuron_buckets.compile.executor import PieceExecutor, Submit
from neuron_buckets.compile.graph_cache import GraphCache
from neuron_buckets.compile.outcome import Notify, Outcome
from neuron_buckets.compile.worker import CompileTask, Toolchain
from neuron_buckets.config import Config
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.pieces import PieceShape
from neuron_buckets.runtime.memory import compile_job_bytes

# Records a piece its worker returned, in ``done`` and the manifest: (outcome, the traceback if it failed).
Finish = Callable[[Outcome, str | None], None]


@dataclass
class PieceQueue:
    config: Config
    model_config: LlamaConfig
    cache: GraphCache
    toolchain: Toolchain
    fail_fast: bool
    ray_address: str | None

    @contextmanager
    def executor(self, jobs: int | None = None) -> Iterator[PieceExecutor]:
        """The executor ``compile.executor`` names: ``jobs`` local processes (default
        ``compile.jobs``), or Ray tasks on the cluster at ``ray_address``."""
        c = self.config.compile
        if c.executor == "ray":
            from neuron_buckets.compile.ray_executor import RayExecutor

            task_bytes = compile_job_bytes(self.config, self.model_config)
            executor = RayExecutor(self.ray_address, c.task_cpus, task_bytes, not self.cache.shared.is_url)
        else:
            from neuron_buckets.compile.local_executor import LocalExecutor

            executor = LocalExecutor(jobs or c.jobs)
        try:
            yield executor
        finally:
            executor.close()

    def stopped(self, done: dict[PieceShape, Outcome]) -> bool:
        """Whether ``--fail-fast`` has seen a failure: nothing more starts."""
        return self.fail_fast and any(o.status != "ok" for o in done.values())

    def run(self, todo: list[Outcome], done: dict[PieceShape, Outcome], finish: Finish, notify: Notify,
            jobs: int | None = None) -> None:
        """Compile ``todo`` (``finish`` records each into ``done``), telling ``notify`` of "queued",
        "retry" and "done"; the executor (Ray's connection) is opened only when something needs it."""
        queue = deque(todo)
        with self.executor(jobs) as executor:
            while queue and not self.stopped(done):
                with executor.pool() as submit:
                    self._drain(executor, submit, queue, done, finish, notify)

    def _task(self, o: Outcome, executor: PieceExecutor) -> CompileTask:
        shared, local = self.cache.shared, self.cache.local
        mirror = local.location if executor.on_this_host and shared is not local else None
        store = shared.location
        return CompileTask(self.config, o.shape, o.key, store, mirror, self.toolchain, executor.threads)

    def _drain(self, executor: PieceExecutor, submit: Submit, queue: deque[Outcome],
               done: dict[PieceShape, Outcome], finish: Finish, notify: Notify) -> None:
        """Feed the pool until the queue is empty, a piece fails under fail-fast, or a worker dies."""
        running: dict[Future, Outcome] = {}
        feeding = True
        while running or (feeding and queue):
            while feeding and queue and len(running) < executor.slots:
                o = queue.popleft()
                o.attempts += 1
                running[submit(self._task(o, executor))] = o
                notify("queued", o)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                o = running.pop(fut)
                err, died = self._result(fut, o, executor)
                feeding = feeding and not died
                if died and o.attempts <= self.config.compile.retries:
                    o.error = f"{died}: the worker died"
                    queue.appendleft(o)
                    notify("retry", o)
                    continue
                if died:
                    err = f"{err}{died}: the worker died on each of {o.attempts} attempts\n"
                o.error = None
                finish(o, err)
                notify("done", o)
                feeding = feeding and not (err and self.fail_fast)

    @staticmethod
    def _result(fut: Future, o: Outcome, executor: PieceExecutor) -> tuple[str | None, str | None]:
        """(the traceback if the piece failed, the exception's name if its worker died)."""
        try:
            o.compile_seconds, err = fut.result()
            return err, None
        except Exception as e:  # the worker could not run it, or died
            return traceback.format_exc(), type(e).__name__ if executor.died(e) else None
