"""Refuse request bodies over a size limit (HTTP 413) or slower than a time limit (HTTP 408),
in OpenAI's error shape, before they are held.

Starlette reads a whole body into memory before a route sees it. Its own body-limit middleware
answers an oversized declared ``Content-Length`` with a plain-text body of its own, past every
exception handler, which OpenAI clients cannot parse. This one raises the 413 from the body
read instead, so the app's handlers shape it: at once for a declared length over the limit, and
the moment the bytes of a chunked body pass it, so a client cannot make the server buffer more.
A client that stops sending in the middle of its body gets a 408 after ``timeout_s`` seconds
without a byte, so a slow trickle cannot hold a connection for ever (headers: ``slow_clients.py``).
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

BODY_TIMEOUT_S = 30.0


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        seen = int(declared) if declared.isdigit() else 0  # a declared length counts at once
        complete = False  # once the body is in, a receive waits for the disconnect, unbounded

        async def limited() -> Message:
            nonlocal seen, complete
            if seen <= self.max_bytes:
                if complete:
                    return await receive()
                try:
                    message = await asyncio.wait_for(receive(), self.timeout_s)
                except TimeoutError:
                    late = f"no byte of the request body came for {self.timeout_s:g} s"
                    raise HTTPException(408, late) from None
                complete = not message.get("more_body", False)
                seen += 0 if declared.isdigit() else len(message.get("body", b""))
                if seen <= self.max_bytes:
                    return message
            raise HTTPException(413, f"the request body is over the server's limit of {self.max_bytes} bytes")

        try:
            await self.app(scope, limited, send)
        except asyncio.CancelledError:  # the shutdown timeout: the stream said so (api_server.sse)
            return
