"""What completions and chat share on the way from a request body to its answer (vLLM's
``OpenAIServing``): the model check, the prompt tokenized and checked off the engine thread, its
choices submitted to the engine loop together, their outputs merged, and the answer streamed or
sent whole. Each endpoint says only what is its own, in an ``Endpoint``: its prompt's ids and
how its outputs read on the wire (``serving_completion.py``, ``serving_chat.py``).

A text prompt or a chat is tokenized on a thread of its own, with its own copy of the tokenizer,
before the request reaches the engine thread, so tokenizing a client's megabyte of text never
holds back the requests already running.
"""

from __future__ import annotations

import asyncio
import copy
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.logprobs import TokenLogprob
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.server.engine_loop import EngineLoop
from neuron_buckets.server.errors import check_model
from neuron_buckets.server.lora_routes import adapter_of
from neuron_buckets.server.metrics import ServerMetrics
from neuron_buckets.server.openai_protocol import ResponseHeader, SamplingRequest, Usage
from neuron_buckets.server.request_stream import RequestStream
from neuron_buckets.server.responses import Choice, choice_params, last_outputs, most_likely, sse
from neuron_buckets.server.worker_thread import WorkerThread
from neuron_buckets.utils.errors import UserError

Body = TypeVar("Body", bound=SamplingRequest)


class Endpoint(ABC, Generic[Body]):
    """One request to one endpoint: its prompt's ids, and its outputs as that endpoint's events."""

    id_prefix: ClassVar[str]  # a response's id: ``cmpl-...``, ``chatcmpl-...``

    def __init__(self, body: Body, server: OpenAIServing) -> None:
        self.body, self.server = body, server
        self.header = ResponseHeader.new(self.id_prefix, server.model_name).model_dump()

    @abstractmethod
    def prompt_ids(self, tokenizer: Tokenizer | None) -> list[int]:
        """The prompt's token ids; called on the tokenizer thread with its tokenizer."""

    def opening(self, index: int) -> BaseModel | None:
        """What a stream sends for choice ``index`` before any output (nothing, by default)."""
        return None

    @abstractmethod
    def event(self, index: int, out: RequestOutput) -> BaseModel | None:
        """The stream's event for choice ``index``'s new output; None when it adds nothing to say."""

    @abstractmethod
    def usage_event(self, usage: Usage) -> BaseModel:
        """The stream's last event when the client asked for usage."""

    @abstractmethod
    def final(self, outs: list[RequestOutput]) -> BaseModel:
        """The whole answer, from each choice's final output."""


class OpenAIServing:
    """The generation routes' shared state: the engine loop, the model's name and its tokenizer."""

    def __init__(self, engine: LLMEngine, model_name: str, max_open_requests: int) -> None:
        self.model_name, self.engine = model_name, engine
        # The engine's tokenizer is the engine thread's (its detokenizers); requests are encoded
        # with a copy of it, on a thread of its own, one at a time.
        self.tokenizer = Tokenizer(copy.deepcopy(engine.tokenizer.hf)) if engine.tokenizer else None
        self.encoder = WorkerThread("nb-tokenize", max_open_requests)  # bounded like open requests
        # Logprobs name tokens by their text, decoded on the event loop with a copy of its own.
        self.decoder = Tokenizer(copy.deepcopy(engine.tokenizer.hf)) if engine.tokenizer else None
        self.token_texts: dict[int, str] = {}
        self.max_open_requests = max_open_requests
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(
            model_name,
            lambda: engine.stats,
            lambda: (engine.pool.queries, engine.pool.hits),
            lambda: engine.spec_stats,
            lambda: engine.step_stats,
            lambda: engine.kv_cache.num_preemptions,
        )
        self.loop = EngineLoop(engine, self.metrics, max_open_requests)
        self.created = int(time.time())

    def close(self) -> None:
        self.loop.stop()
        self.encoder.close()

    def checked(self, endpoint: Endpoint) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and the request's parameters, checked as the engine checks them."""
        ids = endpoint.prompt_ids(self.tokenizer)
        params = endpoint.body.sampling_params(self.max_model_len - len(ids))
        return self.engine.check_request(ids, params), params

    async def prepare(self, endpoint: Endpoint) -> tuple[list[int], SamplingParams]:
        """``checked``, on the tokenizer thread: a refused request never reaches the engine thread."""
        body = endpoint.body
        if body.runs > self.max_open_requests:
            what = f"best_of={body.best_of}" if body.runs > body.n else f"n={body.n}"
            raise UserError(f"{what} needs {body.runs} open requests; this server holds at most "
                            f"{self.max_open_requests}")
        return await self.encoder.run(self.checked, endpoint)

    async def submit(
        self, ids: list[int], params: SamplingParams, n: int, received: float, lora: str | None = None
    ) -> list[RequestStream]:
        """Admit the request's ``n`` choices, each a request of the engine (prefix caching computes
        their shared prompt once) on LoRA adapter ``lora``, or none of them; ``received`` is when
        its handler began."""
        children = [choice_params(params, i) for i in range(n)]
        submits = (self.loop.submit(ids, p, lora, received) for p in children)
        results = await asyncio.gather(*submits, return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        if len(streams) < n:
            for stream in streams:
                self.loop.release(stream)
            raise next(r for r in results if not isinstance(r, RequestStream))
        return streams

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[Choice]:
        """Every choice's outputs as they come, each with its index; closing it aborts the open ones."""
        if len(streams) == 1:
            async for out in self.loop.outputs(streams[0]):
                yield 0, out
            return
        arrived: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in self.loop.outputs(stream):
                    arrived.put_nowait((i, out))
            except Exception as e:
                arrived.put_nowait((i, e))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                i, item = await arrived.get()
                if isinstance(item, Exception):
                    raise item
                left -= item.finished
                yield i, item
        finally:
            for task in pumps:
                task.cancel()

    async def respond(self, endpoint: Endpoint, request: Request) -> BaseModel | Response:
        """Admit a request (or raise the error its status code comes from), then answer with its
        choices' events as they come (``stream``) or with its final response."""
        body, received = endpoint.body, time.perf_counter()
        if (lora := adapter_of(self.engine, body.model)) is None:
            check_model(body.model, self.model_name)
        ids, params = await self.prepare(endpoint)
        if body.runs > body.n:  # ranked by their logprobs, returned only if asked for
            params = replace(params, logprobs=params.logprobs or 0)
        outputs = self.merged(await self.submit(ids, params, body.runs, received, lora))
        if body.stream:
            return sse(self.events(endpoint, outputs))
        if (outs := await last_outputs(outputs, request, body.runs)) is None:
            return Response(status_code=499)  # nobody reads it: the client closed the connection
        return endpoint.final(most_likely(outs, body.n, body.num_logprobs is not None))

    async def events(self, endpoint: Endpoint, outputs: AsyncIterator[Choice]) -> AsyncIterator[BaseModel]:
        """A streamed answer: each choice's opening, its outputs' events, then the usage if asked."""
        try:
            for i in range(endpoint.body.n):
                if (opening := endpoint.opening(i)) is not None:
                    yield opening
            finals: list[RequestOutput] = []
            async for i, out in outputs:
                if (e := endpoint.event(i, out)) is not None:
                    yield e
                if out.finished:
                    finals.append(out)
            if endpoint.body.include_usage:
                yield endpoint.usage_event(Usage.of(finals))
        finally:
            await outputs.aclose()

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs: its own (special tokens too), or ``token_id:N`` (vLLM's
        form) without a tokenizer. Cached, so a token is decoded once per server."""
        if (text := self.token_texts.get(token_id)) is None:
            if self.decoder is None:
                text = f"token_id:{token_id}"
            else:
                text = self.decoder.hf.decode([token_id], skip_special_tokens=False)
            self.token_texts[token_id] = text
        return text

    def decoded(self, ids: list[int]) -> str:
        """``ids`` as text, special tokens kept ('' without a tokenizer)."""
        return "" if self.decoder is None else self.decoder.hf.decode(ids, skip_special_tokens=False)


def new_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """The logprobs of the tokens this output adds."""
    return (out.logprobs or [])[len(out.token_ids) - len(out.new_token_ids) :]
