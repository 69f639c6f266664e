"""How a request's outputs become its HTTP answer: a stream of server-sent events, or the final
outputs once every choice finished (``None`` if the client left first), the ``best_of`` most
likely, and each choice's seed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.server.errors import STATUS, EngineDead, StepFailed, error_response


def sse(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events as OpenAI streams them: one JSON object per event, then ``[DONE]``.

    A failure after the stream started cannot change the status code any more, so it is sent as
    an error event, as vLLM does; so is the end of a stream cut short by the server's shutdown
    timeout, which the client would otherwise see as a bare end of file.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {event.model_dump_json()}\n\n"
        except (EngineDead, StepFailed) as e:
            yield f"data: {error_response(STATUS[type(e)], str(e)).body.decode()}\n\n"
        except asyncio.CancelledError:  # the shutdown timeout: say so, then stop quietly
            cut = error_response(503, "the server shut down before this stream ended")
            yield f"data: {cut.body.decode()}\n\n"
            return
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


Choice = tuple[int, RequestOutput]  # a choice's index and one of its outputs


async def last_outputs(
    outputs: AsyncIterator[Choice], request: Request, n: int
) -> list[RequestOutput] | None:
    """Each choice's final output, or None if the client went away first (the requests are then
    aborted, their blocks freed, rather than run to the end for nobody)."""

    async def final() -> list[RequestOutput]:
        finals = {}
        async for i, out in outputs:  # each choice ends with its finished one
            finals[i] = out
        return [finals[i] for i in range(n)]

    result = asyncio.ensure_future(final())
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (shutdown timeout): the requests are aborted
        watcher.cancel()
        result.cancel()  # no effect once it is done
    return result.result() if result.done() else None


def most_likely(outs: list[RequestOutput], n: int, logprobs: bool) -> list[RequestOutput]:
    """The ``n`` of ``outs`` with the highest mean logprob per token (OpenAI's ``best_of``), most
    likely first; all of them, in order, when there are only ``n``. Logprobs kept if asked for."""
    if len(outs) == n:
        return outs

    def mean(out: RequestOutput) -> float:
        entries = out.logprobs or []
        return sum(e.logprob for e in entries) / max(len(entries), 1)

    best = sorted(outs, key=mean, reverse=True)[:n]
    return best if logprobs else [replace(out, logprobs=None) for out in best]


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: the request's seed plus the index (vLLM's), within 64 bits,
    so a seeded request's choices differ from each other and repeat from run to run."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    return replace(params, seed=seed if seed < 2**64 else seed - 2**64)
