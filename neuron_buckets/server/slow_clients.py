"""Connections that hold the server without sending a request: timed out, and quiet in the log.

uvicorn times out a connection only once a response is complete (``timeout_keep_alive``), so a
client that opens thousands of connections and trickles header bytes into them ("slowloris")
holds each one, and its file descriptor, for ever. ``HeaderTimeoutH11`` closes a connection
whose request headers are not complete ``header_timeout`` seconds after the connection, or the
last response, began waiting for them. Bodies have their own bound (``body_limit.py``).

Near the descriptor limit asyncio logs every failed ``accept()`` with a traceback; under a flood
that is hundreds of megabytes. ``QuietAcceptErrors`` keeps one line per minute instead.
"""

from __future__ import annotations

import asyncio
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutH11(H11Protocol):
    header_timeout = HEADER_TIMEOUT_S

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Armed while the connection waits for a request's headers, cancelled once it has them."""
        if self.conn.their_state is not h11.IDLE:
            self._stop_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class QuietAcceptErrors(logging.Filter):
    """asyncio's "socket.accept() out of system resource": one line a minute, no traceback."""

    every_s = 60.0

    def __init__(self) -> None:
        super().__init__()
        self._last = -self.every_s

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("socket.accept() out of system resource"):
            return True
        now = time.monotonic()
        if now - self._last < self.every_s:
            return False
        self._last = now
        record.exc_info = record.exc_text = None
        record.msg, record.args = "socket.accept() failed: out of file descriptors or memory", ()
        return True
