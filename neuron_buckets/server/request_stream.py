"""One request as its connection sees it, filled from the engine thread: admitted or refused,
then its outputs in order (``engine_loop.py`` fills it, the serving routes read it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from neuron_buckets.engine.request_output import RequestOutput


class RequestStream:
    """One request as its connection sees it: admitted or refused, then its outputs in order.

    The engine thread fills it through ``loop.call_soon_threadsafe``, so asyncio objects are only
    ever touched on their own loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.admitted: asyncio.Future[int] = loop.create_future()
        self.outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.request_id: int | None = None  # set on the engine thread once admitted
        self.attached = True  # cleared on the engine thread when the connection goes away

    def deliver(self, item: RequestOutput | BaseException) -> None:
        if self.attached:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)

    def admit(self, error: BaseException | None) -> None:
        def settle() -> None:
            if self.admitted.done():  # the connection went away while waiting
                return
            if error is None:
                self.admitted.set_result(self.request_id)
            else:
                self.admitted.set_exception(error)

        self.loop.call_soon_threadsafe(settle)


def deliver_step(deliveries: Sequence[tuple[RequestStream, RequestOutput]]) -> None:
    """A step's outputs handed over in one call per event loop, not one per request: each call
    wakes the loop, which then takes the GIL from the engine thread while it hands over the rest."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
    for stream, out in deliveries:
        if stream.attached:
            by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.outputs.put_nowait(out)
