"""The one thread that drives ``LLMEngine.step()`` for every HTTP connection.

The engine is single-threaded, so it lives on a thread of its own and nothing else touches it:
connections hand it work as commands on a queue (add a request, drop one), and it hands each
request's outputs back to the connection's asyncio queue on the event loop. Every step batches
whatever requests are in the engine at that moment, whichever connection they came from; that
is continuous batching across HTTP requests, through the runtime's bucket selection and packing.

Commands run in order between steps, at most ``MAX_COMMANDS`` before each step, so a flood of
submissions cannot hold back the requests already running; a connection that goes away is aborted
(its blocks back in the pool) before the next step runs. When idle the thread sleeps on the
command queue; it does not poll. Tokenizing and chat templating happen before a command is
queued, off this thread (``serving.py``): a client's megabyte of text costs it, not everyone.

An exception from a step (a graph refused at first use, a bug) fails the requests that step
touched: a batch cannot say which row caused it, so each of them gets ``StepFailed`` and is
aborted, its blocks back in the pool. Requests still waiting were not touched and go on, and so
does the loop: one bucket's broken graph fails that bucket's requests, not the server. A step
that fails with no open request to blame is a broken engine: the loop stops, every request
still open gets the error, and ``/health`` says so. So does a step that loses a rank of a
tensor-parallel artifact (``RankLost``): no later step can run, and ``on_fatal`` is told, which
ends the server.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.rank_group import RankLost
from neuron_buckets.server.errors import EngineDead, StepFailed, server_busy
from neuron_buckets.server.metrics import ServerMetrics
from neuron_buckets.server.request_stream import RequestStream, deliver_step
from neuron_buckets.server.trace_recorder import ServedRequest, TraceRecorder
from neuron_buckets.utils.errors import UserError

log = logging.getLogger("nb.serve")

# Commands run between two steps at most: a queue of thousands of adds waits for later steps
# instead of delaying the running requests' next token by all of them.
MAX_COMMANDS = 64


@dataclass
class Connection:
    """What only the server keeps of an open request: where its outputs go, and its timings
    (the request itself, its tokens, sampling and stop rule, is the engine's ``Request``)."""

    stream: RequestStream
    arrival: float
    scheduled: float | None = None  # when the step that first admitted it began (vLLM's SCHEDULED)
    first_token: float | None = None
    last_token: float | None = None


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_open_requests: int) -> None:
        self.engine, self.metrics, self.max_open_requests = engine, metrics, max_open_requests
        # Taken when a connection submits, given back by the engine thread when the request is
        # refused or finishes: it bounds the requests queued, waiting and running together.
        self._open = threading.BoundedSemaphore(max_open_requests)
        self.error: str | None = None  # why the loop stopped, if a step failed
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._connections: dict[int, Connection] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nb-engine-loop", daemon=True)
        self.on_fatal: Callable[[str], None] | None = None  # told why, when a rank is lost
        self.trace = TraceRecorder()  # what it served, for nb replan (no text)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort whatever is still open, let the engine report it, and end the thread."""
        self._commands.put(self._begin_stop)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def dead(self) -> EngineDead:
        return EngineDead(f"the engine loop stopped: {self.error or 'the server is shutting down'}")

    async def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, lora: str | None = None,
        received: float | None = None,
    ) -> RequestStream:
        """Admit one request, its prompt's ids and its sampling parameters (``received``: when its
        HTTP handler began, ``time.perf_counter``; for the engine's TTFT trace), into the engine, or
        raise: ``ServerBusy`` over the bound, the engine's ``UserError`` or ``ValueError`` for a
        request that can never complete, ``EngineDead``. Read its outputs with ``outputs``.
        ``lora``: the LoRA adapter it runs with (None: the base model).

        The server tokenizes and checks a request before it submits, off this thread
        (``serving.py``): what reaches the engine thread is data, ready to add.
        """
        if not self.alive:
            raise self.dead()
        if not self._open.acquire(blocking=False):
            raise server_busy(self.max_open_requests)
        stream, arrival = RequestStream(asyncio.get_running_loop()), time.monotonic()
        submitted = time.perf_counter()
        stamps = (submitted if received is None else received, submitted)
        self._commands.put(partial(self._add, stream, prompt_ids, params, arrival, lora, stamps))
        if not self.alive:  # it died after the check above: the command may never run
            stream.admit(self.dead())
        try:
            await stream.admitted
        except asyncio.CancelledError:
            self._commands.put(lambda: self._drop(stream))
            raise
        return stream

    def release(self, stream: RequestStream) -> None:
        """Abort an admitted request whose outputs nobody will read (a sibling choice was refused)."""
        self._commands.put(lambda: self._drop(stream))

    async def outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; stopping early (the client went away, the
        task was cancelled) aborts it before the engine's next step."""
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(lambda: self._drop(stream))

    # Everything below runs on the engine thread.

    def _add(
        self, stream: RequestStream, prompt_ids: Sequence[int], params: SamplingParams, arrival: float,
        lora: str | None, stamps: tuple[float, float],
    ) -> None:
        if self.error is not None:
            stream.admit(self.dead())
            return
        try:
            stream.request_id = self.engine.add_request(prompt_ids, params, lora)
        except Exception as e:  # refused; the engine checks before it changes anything
            if not isinstance(e, UserError | ValueError):
                log.exception("a request could not be added")
            self._open.release()
            stream.admit(e)
            return
        self._connections[stream.request_id] = Connection(stream, arrival)
        if self.engine.ttft is not None:
            self.engine.ttft.added(stream.request_id, len(prompt_ids), *stamps)
        stream.admit(None)

    def _drop(self, stream: RequestStream) -> None:
        """The connection is gone: abort its request if it is still open; the blocks go back now."""
        stream.attached = False
        if stream.request_id in self._connections:
            self.engine.abort(stream.request_id)

    def _begin_stop(self) -> None:
        self._stopping = True
        for connection in self._connections.values():
            connection.stream.deliver(EngineDead("the server is shutting down"))
            self._drop(connection.stream)

    def _run(self) -> None:
        try:
            while not (self._stopping and not self.engine.has_unfinished):
                self._drain(block=not self.engine.has_unfinished and not self._stopping)
                began = time.monotonic()
                outputs = self._step() if self.engine.has_unfinished else []
                self._mark_scheduled(began)
                self.metrics.running.set(self.engine.num_running)
                self.metrics.waiting.set(self.engine.num_waiting)
                self.metrics.kv_usage.set(self.engine.kv_cache.usage)
                # Counted before delivered: a client holding its final output finds it in
                # /metrics and may send its next request at once without meeting its own slot.
                deliver_step(self._record(outputs, time.monotonic()))
        except Exception as e:
            log.exception("the engine loop stopped")
            self.error = f"{type(e).__name__}: {e}"
            for connection in self._connections.values():
                connection.stream.deliver(self.dead())
            self._drain(block=False)  # requests queued meanwhile are refused
            if isinstance(e, RankLost) and self.on_fatal is not None:
                self.on_fatal(self.error)

    def _step(self) -> list[RequestOutput]:
        """``engine.step()``; if it raises, the requests it touched (all but the waiting ones)
        get ``StepFailed`` and are aborted, and the loop carries on. A step that fails with no
        request to blame fails for good: the error stops the loop."""
        try:
            return self.engine.step()
        except Exception as e:
            waiting = {r.request_id for r in self.engine.scheduler.waiting}
            failed = [rid for rid in self._connections if rid not in waiting]
            if not failed or isinstance(e, RankLost):
                raise
            why = f"{type(e).__name__}: {e}"
            if isinstance(e, UserError):  # a refused graph: its message says it all
                log.error("a step failed, %d request(s) aborted: %s", len(failed), why)
            else:
                log.exception("a step failed, %d request(s) aborted", len(failed))
            for rid in failed:
                connection = self._connections.pop(rid)
                connection.stream.deliver(StepFailed(f"the step running this request failed: {why}"))
                connection.stream.attached = False
                self.engine.abort(rid)
                self._open.release()
                self.metrics.finished("abort")
            return []

    def between_steps(self, command: Callable[[], object]) -> Future:
        """Run ``command`` on the engine thread between two steps (nothing else touches the
        engine then); its result or exception in the future."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(command())
            except Exception as e:  # handed to whoever waits on it
                future.set_exception(e)

        self._commands.put(run)
        return future

    def _drain(self, block: bool) -> None:
        """Run up to ``MAX_COMMANDS`` queued commands; wait for the first one when there is
        nothing else to do."""
        if block:
            self._commands.get()()
        for _ in range(MAX_COMMANDS):
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _mark_scheduled(self, began: float) -> None:
        """Stamp the requests this step admitted for the first time with its start, as vLLM stamps
        a request when its scheduler first schedules it (a readmission after preemption keeps the
        first stamp)."""
        waiting = {r.request_id for r in self.engine.scheduler.waiting}
        for rid, connection in self._connections.items():
            if connection.scheduled is None and rid not in waiting:
                connection.scheduled = began

    def _record(self, outputs: list[RequestOutput], now: float) -> list[tuple[RequestStream, RequestOutput]]:
        """Record what vLLM records for a step's outputs, release finished requests' slots, and
        say where each output goes."""
        deliveries = []
        for out in outputs:
            if (connection := self._connections.get(out.request_id)) is None:
                continue
            if out.new_token_ids:
                if connection.last_token is None:
                    connection.first_token = now
                    self.metrics.ttft.observe(now - connection.arrival)
                    self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
                else:
                    per_token = (now - connection.last_token) / len(out.new_token_ids)
                    for _ in out.new_token_ids:
                        self.metrics.tpot.observe(per_token)
                connection.last_token = now
                self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                del self._connections[out.request_id]
                self._open.release()
                self.metrics.e2e.observe(now - connection.arrival)
                self.metrics.intervals(connection.arrival, connection.scheduled, connection.first_token,
                                       connection.last_token)
                self.metrics.finished(out.finish_reason)
                arrival_ms = (time.time() - (now - connection.arrival)) * 1e3
                self.trace.add(ServedRequest(arrival_ms, len(out.prompt_token_ids), out.num_cached_tokens,
                                             len(out.token_ids)))
            deliveries.append((connection.stream, out))
        return deliveries
