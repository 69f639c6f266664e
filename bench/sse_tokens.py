"""The token ids of one streamed ``/v1/completions`` answer, event by event, as the serving benches
read ``nb serve``'s server-sent events (``return_token_ids``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp


async def token_events(session: aiohttp.ClientSession, url: str, body: dict,
                       headers: dict[str, str] | None = None) -> AsyncIterator[list[int]]:
    """Each event's token ids, up to ``[DONE]``; an answer that ends before it raises."""
    async with session.post(url, json={**body, "stream": True, "return_token_ids": True},
                            headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            data = line.decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                return
            if data:
                yield [t for c in json.loads(data)["choices"] for t in c.get("token_ids") or ()]
    raise RuntimeError("the stream ended before [DONE]")
