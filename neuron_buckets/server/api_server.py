"""``nb serve``: an OpenAI-compatible HTTP server over one artifact directory (FastAPI + uvicorn).

Routes: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (both stream as
server-sent events with ``"stream": true``), ``/health`` and ``/metrics`` (Prometheus). Every
connection's request goes to the one engine loop (``engine_loop.py``), which batches them all.

Errors have OpenAI's shape and status codes a client can act on: 400 for a request that can
never be served (bad fields, too long for ``max_model_len``, no tokenizer or chat template),
404 for another model's name, 413 for a body over the size limit, 429 when the server already
holds its limit of open requests, 500 for a request whose step failed (the others go on), 503
once the engine has stopped. Nothing is compiled at start and no graph is loaded before it
listens: each loads on first use.

Who may call it is ``access.py`` (API key, Host header); connections that send too slowly are
closed by ``slow_clients.py`` and ``body_limit.py``. A text prompt or a chat is tokenized on a
thread of its own, with its own copy of the tokenizer, before the request reaches the engine
thread, so tokenizing a client's megabyte of text never holds back the requests already running.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from http import HTTPStatus
from pathlib import Path

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.engine.embedder import Embedder
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.logprobs import TokenLogprob
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.server import hermes_tool_parser
from neuron_buckets.server.access import ServerAccess, is_loopback
from neuron_buckets.server.body_limit import BODY_TIMEOUT_S, BodyLimit
from neuron_buckets.server.embedding_protocol import EmbeddingRequest, EmbeddingResponse
from neuron_buckets.server.embedding_server import NOT_EMBEDDING, NOT_GENERATION, EmbeddingServer
from neuron_buckets.server.engine_loop import (
    Encode,
    EngineDead,
    EngineLoop,
    RequestStream,
    ServerBusy,
    StepFailed,
)
from neuron_buckets.server.metrics import ServerMetrics
from neuron_buckets.server.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseHeader,
    SamplingRequest,
    ToolCallDelta,
    Usage,
)
from neuron_buckets.server.slow_clients import HeaderTimeoutH11, QuietAcceptErrors
from neuron_buckets.utils.errors import UserError

log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep a flood of clients from growing the server's memory without limit."""

    max_open_requests: int = 256  # queued, waiting for blocks and running, together; more get 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before they are buffered
    body_timeout_s: float = BODY_TIMEOUT_S  # a body that stops this long before its end gets 408


def error_response(status: int, message: str) -> JSONResponse:
    kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    """pydantic's errors as one line: 'temperature: Input should be a valid number; ...'."""
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"] if p != "body")
        message = e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


# The status of each error a route may raise; the first type that matches wins.
STATUS: dict[type[Exception], int] = {
    ServerBusy: 429, EngineDead: 503, StepFailed: 500, UserError: 400, ValueError: 400, Exception: 500
}


async def on_error(_: Request, e: Exception) -> JSONResponse:
    """Every refusal in OpenAI's error shape."""
    if isinstance(e, HTTPException):
        return error_response(e.status_code, str(e.detail))
    if isinstance(e, RequestValidationError):
        return error_response(400, validation_message(e))
    return error_response(next(s for t, s in STATUS.items() if isinstance(e, t)), str(e))


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


class OpenAIServer:
    """The routes' shared state: the engine loop, the model's name and its tokenizer."""

    def __init__(self, engine: LLMEngine, model_name: str, limits: ServerLimits) -> None:
        self.model_name, self.engine = model_name, engine
        # The engine's tokenizer is the engine thread's (its detokenizers); requests are encoded
        # with a copy of it, on a thread of its own, one at a time.
        self.tokenizer = Tokenizer(copy.deepcopy(engine.tokenizer.hf)) if engine.tokenizer else None
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="nb-tokenize")
        self.encoding = 0  # requests being tokenized or waiting to be, bounded like open ones
        # Logprobs name tokens by their text, decoded on the event loop with a copy of its own.
        self.decoder = Tokenizer(copy.deepcopy(engine.tokenizer.hf)) if engine.tokenizer else None
        self.token_texts: dict[int, str] = {}
        self.max_open_requests = limits.max_open_requests
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(
            model_name,
            lambda: engine.stats,
            lambda: (engine.pool.queries, engine.pool.hits),
            lambda: engine.spec_stats,
            lambda: engine.step_stats,
            lambda: engine.kv_cache.num_preemptions,
        )
        self.loop = EngineLoop(engine, self.metrics, limits.max_open_requests)
        self.created = int(time.time())

    def check_model(self, body: SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise HTTPException(404, f"the model {body.model!r} does not exist; this server serves "
                                     f"{self.model_name!r}")

    def encode(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, list):
            return body.prompt
        if self.tokenizer is None:
            raise UserError("this artifact has no tokenizer: send the prompt as a list of token ids")
        return self.tokenizer.encode(body.prompt, body.add_special_tokens)

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise UserError("this artifact has no tokenizer, so it cannot render chat messages")
        messages = [m.as_template_input() for m in body.messages]
        return self.tokenizer.apply_chat_template(messages, body.add_special_tokens, body.template_tools())

    async def prepare(self, body: SamplingRequest, encode: Encode) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and the request's parameters, checked as the engine checks them, on the
        tokenizer thread: a refused request never reaches the engine thread."""
        if body.runs > self.max_open_requests:
            what = f"best_of={body.best_of}" if body.runs > body.n else f"n={body.n}"
            raise UserError(f"{what} needs {body.runs} open requests; this server holds at most "
                            f"{self.max_open_requests}")
        if self.encoding >= self.max_open_requests:
            limit = self.max_open_requests
            raise ServerBusy(f"the server holds its limit of {limit} open requests; retry later")

        def work() -> tuple[list[int], SamplingParams]:
            ids = encode()
            params = body.sampling_params(self.max_model_len - len(ids))
            return self.engine.check_request(ids, params), params

        self.encoding += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.encoder, work)
        finally:
            self.encoding -= 1

    async def submit(self, ids: list[int], params: SamplingParams, n: int) -> list[RequestStream]:
        """Admit the request's ``n`` choices, each a request of the engine (prefix caching computes
        their shared prompt once), or none of them."""
        children = [choice_params(params, i) for i in range(n)]
        results = await asyncio.gather(
            *(self.loop.submit(lambda: ids, lambda _, p=p: p) for p in children), return_exceptions=True
        )
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

    async def respond(
        self,
        body: SamplingRequest,
        encode: Encode,
        request: Request,
        event: Callable[[int, RequestOutput], BaseModel | None],
        usage_event: Callable[[Usage], BaseModel],
        final: Callable[[list[RequestOutput]], BaseModel],
        first: Callable[[int], BaseModel] | None = None,
    ) -> BaseModel | Response:
        """Admit a request (or raise the error its status code comes from), then answer with its
        choices' events as they come (``stream``) or with its ``final`` response."""
        self.check_model(body)
        ids, params = await self.prepare(body, encode)
        if body.runs > body.n:  # ranked by their logprobs, returned only if asked for
            params = replace(params, logprobs=params.logprobs or 0)
        outputs = self.merged(await self.submit(ids, params, body.runs))
        if body.stream:

            async def events() -> AsyncIterator[BaseModel]:
                try:
                    for i in range(body.n) if first is not None else ():
                        yield first(i)
                    finals: list[RequestOutput] = []
                    async for i, out in outputs:
                        if (e := event(i, out)) is not None:
                            yield e
                        if out.finished:
                            finals.append(out)
                    if body.include_usage:
                        yield usage_event(Usage.of(finals))
                finally:
                    await outputs.aclose()

            return sse(events())
        if (outs := await last_outputs(outputs, request, body.runs)) is None:
            return Response(status_code=499)  # nobody reads it: the client closed the connection
        return final(most_likely(outs, body.n, body.num_logprobs is not None))

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

    def new_logprobs(self, out: RequestOutput) -> list[TokenLogprob]:
        """The logprobs of the tokens this output adds."""
        return (out.logprobs or [])[len(out.token_ids) - len(out.new_token_ids) :]

    def prompt_text(self, body: CompletionRequest, ids: list[int]) -> str:
        """The prompt as ``echo`` repeats it: as sent, or its ids decoded ('' without a tokenizer)."""
        if isinstance(body.prompt, str):
            return body.prompt
        return "" if self.decoder is None else self.decoder.hf.decode(ids, skip_special_tokens=False)

    async def completion(self, body: CompletionRequest, request: Request) -> BaseModel | Response:
        header = ResponseHeader.new("cmpl", self.model_name).model_dump()
        offsets = [0] * body.n  # each streamed choice's text so far, where its next token's text starts
        echoed = [False] * body.n  # whether choice i has sent the prompt (``echo``) yet

        def choice(i: int, text: str, ids: list[int], out: RequestOutput, entries: list[TokenLogprob]):
            if body.echo_only:  # the one token the engine ran is not the client's
                text, ids, entries = "", [], []
            shown_ids: list[int] = ids
            shown: list[TokenLogprob | None] = list(entries)
            if body.echo and not echoed[i]:  # the prompt comes first, once per choice
                echoed[i] = True
                text = self.prompt_text(body, out.prompt_token_ids) + text
                shown_ids = [*out.prompt_token_ids, *ids]
                shown = [*(out.prompt_logprobs or []), *entries]
            logprobs = None
            if body.logprobs is not None:
                logprobs = CompletionLogprobs.of(shown_ids, shown, self.token_text, offsets[i])
                offsets[i] += sum(len(t) for t in logprobs.tokens)
            return CompletionChoice(
                index=i, text=text, finish_reason=out.finish_reason, logprobs=logprobs,
                token_ids=ids if body.return_token_ids else None,
            )

        def event(i: int, out: RequestOutput) -> Completion | None:
            wanted = body.return_token_ids or body.logprobs is not None
            if out.new_text or out.finished or (out.new_token_ids and wanted):
                c = choice(i, out.new_text, out.new_token_ids, out, self.new_logprobs(out))
                return Completion(**header, choices=[c])
            return None  # a token that adds no text yet (part of a character, a held stop string)

        def usage(counted: Usage) -> Usage:
            if not body.echo_only:
                return counted
            prompt = counted.prompt_tokens
            return Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt)

        def final(outs: list[RequestOutput]) -> Completion:
            choices = [choice(i, o.text, o.token_ids, o, o.logprobs or []) for i, o in enumerate(outs)]
            return Completion(**header, choices=choices, usage=usage(Usage.of(outs)))

        return await self.respond(
            body, partial(self.encode, body), request, event,
            usage_event=lambda counted: Completion(**header, choices=[], usage=usage(counted)), final=final,
        )

    async def chat_completion(self, body: ChatCompletionRequest, request: Request) -> BaseModel | Response:
        header = ResponseHeader.new("chatcmpl", self.model_name).model_dump()

        def logprobs(entries: list[TokenLogprob]) -> ChatLogprobs | None:
            return ChatLogprobs.of(entries, self.token_text) if body.logprobs else None

        def reply(out: RequestOutput) -> tuple[AssistantMessage, str | None]:
            """The message and finish reason of a finished choice: its tool calls parsed, if any."""
            content, calls = hermes_tool_parser.parse(out.text) if body.parses_tool_calls else (out.text, [])
            message = AssistantMessage(content=content, tool_calls=calls)
            return message, "tool_calls" if calls else out.finish_reason

        def event(i: int, out: RequestOutput) -> ChatCompletionChunk | None:
            if body.parses_tool_calls:  # a call is only known whole: the reply comes as one chunk
                if not out.finished:
                    return None
                message, reason = reply(out)
                calls = [ToolCallDelta(index=k, **c.model_dump()) for k, c in enumerate(message.tool_calls)]
                delta = ChatDelta(content=message.content, tool_calls=calls or None)
                entries = out.logprobs or []
            elif out.new_text or out.finished or (out.new_token_ids and body.logprobs):
                delta, reason = ChatDelta(content=out.new_text or None), out.finish_reason
                entries = self.new_logprobs(out)
            else:
                return None
            choice = ChatChunkChoice(index=i, delta=delta, finish_reason=reason, logprobs=logprobs(entries))
            return ChatCompletionChunk(**header, choices=[choice])

        def final(outs: list[RequestOutput]) -> ChatCompletion:
            choices = []
            for i, out in enumerate(outs):
                message, reason = reply(out)
                entries = logprobs(out.logprobs or [])
                choices.append(ChatChoice(index=i, message=message, finish_reason=reason, logprobs=entries))
            return ChatCompletion(**header, choices=choices, usage=Usage.of(outs))

        def first(i: int) -> ChatCompletionChunk:
            role = ChatDelta(role="assistant", content="")
            return ChatCompletionChunk(**header, choices=[ChatChunkChoice(index=i, delta=role)])

        return await self.respond(
            body, partial(self.encode_chat, body), request, event,
            usage_event=lambda usage: ChatCompletionChunk(**header, choices=[], usage=usage),
            final=final, first=first,
        )


LOOPBACK_ONLY = ServerAccess()


def create_app(
    engine: LLMEngine | Embedder, model_name: str, limits: ServerLimits = ServerLimits(),
    access: ServerAccess = LOOPBACK_ONLY,
) -> FastAPI:
    """The FastAPI app over one engine; its lifespan starts and stops the engine loop thread.
    ``access`` defaults to no key and a loopback server's Host check. An embedding artifact's
    ``Embedder`` gets ``create_embedding_app``'s."""
    if isinstance(engine, Embedder):
        return create_embedding_app(engine, model_name, limits, access)
    server = OpenAIServer(engine, model_name, limits)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        yield
        await asyncio.to_thread(server.loop.stop)
        server.encoder.shutdown(wait=False, cancel_futures=True)

    def routes(app: FastAPI, v1: APIRouter) -> None:
        app.state.engine_loop = server.loop

        @app.get("/health")
        async def health() -> Response:
            if server.loop.alive:
                return Response(status_code=200)
            return error_response(503, str(server.loop.dead()))

        @app.get("/metrics", dependencies=[Depends(access.check_metrics)])
        async def metrics() -> Response:
            return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

        @v1.post("/completions", response_model=None)
        async def completions(body: CompletionRequest, request: Request) -> BaseModel | Response:
            return await server.completion(body, request)

        @v1.post("/chat/completions", response_model=None)
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> BaseModel | Response:
            return await server.chat_completion(body, request)

        @v1.post("/embeddings", response_model=None)
        async def embeddings() -> Response:  # whatever the body: the artifact is what is wrong
            raise UserError(NOT_EMBEDDING)

    card = ModelCard(id=model_name, created=server.created, max_model_len=server.max_model_len)
    return openai_app(lifespan, card, limits, access, routes)


def create_embedding_app(
    embedder: Embedder, model_name: str, limits: ServerLimits = ServerLimits(),
    access: ServerAccess = LOOPBACK_ONLY,
) -> FastAPI:
    """The FastAPI app over an embedding artifact: ``/v1/embeddings``, and a 400 that says why
    for the generation routes."""
    server = EmbeddingServer(embedder, model_name, limits.max_open_requests)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.close()

    def routes(app: FastAPI, v1: APIRouter) -> None:
        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @v1.post("/embeddings")
        async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
            if body.model is not None and body.model != model_name:
                raise HTTPException(404, f"the model {body.model!r} does not exist; this server serves "
                                         f"{model_name!r}")
            return await server.embeddings(body)

        @v1.post("/completions", response_model=None)
        @v1.post("/chat/completions", response_model=None)
        async def generation() -> Response:  # whatever the body: the artifact is what is wrong
            raise UserError(NOT_GENERATION)

    card = ModelCard(id=model_name, created=server.created, max_model_len=embedder.max_model_len)
    return openai_app(lifespan, card, limits, access, routes)


def openai_app(
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]], card: ModelCard, limits: ServerLimits,
    access: ServerAccess, routes: Callable[[FastAPI, APIRouter], None],
) -> FastAPI:
    """What every nb server's app has: the access checks, the body limit, OpenAI's error shape,
    ``/v1/models`` with ``card`` and the API description; ``routes`` adds the rest."""
    # FastAPI's own description routes take no dependencies, so they are off and served below,
    # behind the key like /v1.
    app = FastAPI(
        title="nb serve", lifespan=lifespan, dependencies=[Depends(access.check_host)],
        openapi_url=None, docs_url=None, redoc_url=None,
    )
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(access.check_key)])
    described = APIRouter(dependencies=[Depends(access.check_key)], include_in_schema=False)

    for exc_type in (*STATUS, HTTPException, RequestValidationError):
        app.add_exception_handler(exc_type, on_error)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    routes(app, v1)

    @described.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @described.get("/docs")
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @described.get("/redoc")
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)

    app.include_router(v1)
    app.include_router(described)
    return app


def run_server(
    directory: Path,
    host: str,
    port: int,
    model_name: str | None = None,
    limits: ServerLimits = ServerLimits(),
    shutdown_timeout: float = 30.0,
    speculative: SpeculativeConfig | None = None,
    access: ServerAccess | None = None,
    preload: bool = False,
    pooling: str | None = None,
) -> None:
    """Open the artifact (drafting as ``speculative`` says; with ``preload`` every graph loaded
    before the first request, not by it) and serve it until SIGINT or SIGTERM. An embedding
    artifact is served by its ``Embedder`` (pooling as ``pooling`` says, else as compiled).

    The address is taken first, so a port in use is one error line before any weight is read.
    On a signal uvicorn stops accepting connections and lets open responses finish for up to
    ``shutdown_timeout`` seconds; what is still open then is cancelled (and aborted in the
    engine), and the engine loop ends once the engine has released every request. A lost rank
    of a tensor-parallel artifact ends it too: open requests get 503, and the server stops with
    one line.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    access = access or ServerAccess.for_bind(host, None, False, ())
    with sock:
        model_name = model_name or str(directory)
        start = time.perf_counter()
        engine: LLMEngine | Embedder
        if read_manifest(directory).embedding is not None:
            if speculative is not None:  # a runtime file or a flag, which nothing here would read
                raise UserError("an embedding artifact does not decode: drop the speculative options")
            engine = Embedder.open(directory, pooling=pooling, preload=preload)
        else:
            if pooling is not None:
                raise UserError(f"--pooling: {NOT_EMBEDDING}")
            engine = LLMEngine.open(directory, speculative=speculative, preload=preload)
        app = create_app(engine, model_name, limits, access)
        loaded = f"{len(engine.runtime.loaded)} graphs" if preload else "graphs load on first use"
        log.info("opened %s in %.1f s (%s)", directory, time.perf_counter() - start, loaded)
        config = uvicorn.Config(
            app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout, http=HeaderTimeoutH11
        )
        logging.getLogger("asyncio").addFilter(QuietAcceptErrors())
        address = f"[{host}]" if family == socket.AF_INET6 else host
        url = f"http://{address}:{sock.getsockname()[1]}"  # the port taken, when 0 asked for any
        if access.api_key is None and not is_loopback(host):
            log.warning("serving on %s without --api-key: anyone who can reach it may generate", host)
        log.info("serving %r at %s (CTRL+C to quit)", model_name, url)
        server = uvicorn.Server(config)
        stopped: list[str] = []

        def fatal(why: str) -> None:  # the engine can never step again: end the server
            stopped.append(why)
            server.should_exit = True

        if isinstance(engine, LLMEngine):
            app.state.engine_loop.on_fatal = fatal
        server.run(sockets=[sock])
        engine.runtime.close()
        if stopped:
            raise UserError(f"the engine stopped: {stopped[0]}")
