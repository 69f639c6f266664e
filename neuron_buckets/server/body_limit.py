"""Refuse request bodies over a size limit (HTTP 413, OpenAI's error shape) before they are held.

Starlette reads a whole body into memory before a route sees it. Its own body-limit middleware
answers an oversized declared ``Content-Length`` with a plain-text body of its own, past every
exception handler, which OpenAI clients cannot parse. This one raises the 413 from the body
read instead, so the app's handlers shape it: at once for a declared length over the limit, and
the moment the bytes of a chunked body pass it, so a client cannot make the server buffer more.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        seen = int(declared) if declared.isdigit() else 0  # a declared length counts at once

        async def limited() -> Message:
            nonlocal seen
            if seen <= self.max_bytes:
                message = await receive()
                seen += 0 if declared.isdigit() else len(message.get("body", b""))
                if seen <= self.max_bytes:
                    return message
            raise HTTPException(413, f"the request body is over the server's limit of {self.max_bytes} bytes")

        await self.app(scope, limited, send)
