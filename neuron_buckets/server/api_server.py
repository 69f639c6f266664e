"""``nb serve``: an OpenAI-compatible HTTP server over one artifact directory (FastAPI + uvicorn).

Routes: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (both stream as
server-sent events with ``"stream": true``), ``/v1/embeddings`` for an embedding artifact,
``/health`` and ``/metrics`` (Prometheus). Every connection's request goes to the one engine loop
(``engine_loop.py``), which batches them all. This module is the app and its launcher; each
endpoint is a room of its own over a shared base (``serving.py``, ``serving_completion.py``,
``serving_chat.py``, ``serving_embedding.py``), with its wire format beside it (``*_protocol.py``).

Errors have OpenAI's shape and status codes a client can act on (``errors.py``); a body over the
size limit gets 413. Nothing is compiled at start and no graph is loaded before it listens: each
loads on first use. Who may call it is ``access.py`` (API key, Host header); connections that send
too slowly are closed by ``slow_clients.py`` and ``body_limit.py``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.engine.embedder import Embedder
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.open_artifact import NOT_EMBEDDING, NOT_GENERATION, open_artifact
from neuron_buckets.runtime.rank_worker import RankFollower, other_rank
from neuron_buckets.server.access import ServerAccess, is_loopback
from neuron_buckets.server.body_limit import BODY_TIMEOUT_S, BodyLimit
from neuron_buckets.server.chat_protocol import ChatCompletionRequest
from neuron_buckets.server.completion_protocol import CompletionRequest
from neuron_buckets.server.embedding_protocol import EmbeddingRequest, EmbeddingResponse
from neuron_buckets.server.errors import STATUS, error_response, on_error
from neuron_buckets.server.lora_routes import AdapterCollector, adapter_cards, lora_routes
from neuron_buckets.server.openai_protocol import ModelCard, ModelList
from neuron_buckets.server.serving import OpenAIServing
from neuron_buckets.server.serving_admin import AdminOptions, ServingAdmin
from neuron_buckets.server.serving_chat import ChatEndpoint
from neuron_buckets.server.serving_completion import CompletionEndpoint
from neuron_buckets.server.serving_embedding import OpenAIServingEmbedding
from neuron_buckets.server.slow_clients import HeaderTimeoutH11, QuietAcceptErrors
from neuron_buckets.utils.errors import UserError

log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep a flood of clients from growing the server's memory without limit."""

    max_open_requests: int = 256  # queued, waiting for blocks and running, together; more get 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before they are buffered
    body_timeout_s: float = BODY_TIMEOUT_S  # a body that stops this long before its end gets 408


LOOPBACK_ONLY = ServerAccess()
NO_ADMIN = AdminOptions()  # the trace kept in memory only, no background re-plans


def create_app(
    engine: LLMEngine | Embedder, model_name: str, limits: ServerLimits = ServerLimits(),
    access: ServerAccess = LOOPBACK_ONLY, admin: AdminOptions = NO_ADMIN,
) -> FastAPI:
    """The FastAPI app over one engine; its lifespan starts and stops the engine loop thread and
    the admin side (``serving_admin.py``: the trace, reloads, re-plans, as ``admin`` says).
    ``access`` defaults to no key and a loopback server's Host check. An embedding artifact's
    ``Embedder`` gets ``create_embedding_app``'s."""
    if isinstance(engine, Embedder):
        return create_embedding_app(engine, model_name, limits, access)
    server = OpenAIServing(engine, model_name, limits.max_open_requests)
    side = ServingAdmin(server.loop, server.metrics, admin)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        side.start()
        yield
        await asyncio.to_thread(side.stop)
        await asyncio.to_thread(server.close)

    def routes(app: FastAPI, v1: APIRouter) -> None:
        app.state.engine_loop, app.state.admin = server.loop, side

        @app.get("/health")
        async def health() -> Response:
            if server.loop.alive:
                return Response(status_code=200)
            return error_response(503, str(server.loop.dead()))

        @app.get("/metrics", dependencies=[Depends(access.check_metrics)])
        async def metrics() -> Response:
            return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

        if (trace := server.engine.ttft) is not None:  # NB_TRACE_TTFT=1 (engine/ttft_trace.py)
            @app.get("/debug/ttft", dependencies=[Depends(access.check_metrics)])
            async def ttft() -> dict:
                return await asyncio.wrap_future(server.loop.between_steps(trace.report))

        @v1.post("/completions", response_model=None)
        async def completions(body: CompletionRequest, request: Request) -> BaseModel | Response:
            return await server.respond(CompletionEndpoint(body, server), request)

        @v1.post("/chat/completions", response_model=None)
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> BaseModel | Response:
            return await server.respond(ChatEndpoint(body, server), request)

        @v1.post("/embeddings", response_model=None)
        async def embeddings() -> Response:  # whatever the body: the artifact is what is wrong
            raise UserError(NOT_EMBEDDING)

        side.routes(app, access)
        lora_routes(v1, engine, server.loop)

    server.metrics.registry.register(AdapterCollector(model_name, lambda: engine.adapters))
    card = ModelCard(id=model_name, created=server.created, max_model_len=server.max_model_len)
    return openai_app(lifespan, card, limits, access, routes, lambda: adapter_cards(engine, card))


def create_embedding_app(
    embedder: Embedder, model_name: str, limits: ServerLimits = ServerLimits(),
    access: ServerAccess = LOOPBACK_ONLY,
) -> FastAPI:
    """The FastAPI app over an embedding artifact: ``/v1/embeddings``, and a 400 that says why
    for the generation routes."""
    server = OpenAIServingEmbedding(embedder, model_name, limits.max_open_requests)

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
    more_cards: Callable[[], list[ModelCard]] = list,
) -> FastAPI:
    """What every nb server's app has: the access checks, the body limit, OpenAI's error shape,
    ``/v1/models`` with ``card`` (and ``more_cards``: LoRA adapters) and the API description;
    ``routes`` adds the rest."""
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
        return ModelList(data=[card, *more_cards()])

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


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound; a port in use (or any refusal) is one error line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


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
    admin: AdminOptions = NO_ADMIN,
    loras: dict[str, Path] | None = None,
) -> None:
    """Open the artifact (``open_artifact``: drafting as ``speculative`` says; with ``preload``
    every graph loaded before the first request, not by it; an embedding artifact pooling as
    ``pooling`` says; ``loras``, name -> PEFT directory, loaded) and serve it until SIGINT or
    SIGTERM. A rank other than 0 of a tensor-parallel artifact follows rank 0 instead, which
    serves: it takes no address.

    The address is taken first, so a port in use is one error line before anything is read; only
    a process that the environment names another rank than 0 reads the manifest first, to know
    whether it follows. On a signal uvicorn stops accepting connections and lets open responses
    finish for up to ``shutdown_timeout`` seconds; what is still open then is cancelled (and
    aborted in the engine), and the engine loop ends once the engine has released every request.
    A lost rank of a tensor-parallel artifact ends it too: open requests get 503, and the server
    stops with one line.
    """
    taken = None if other_rank() else listen(host, port)
    with taken or nullcontext():
        start = time.perf_counter()
        served = open_artifact(directory, speculative, preload, pooling)
        if isinstance(served, RankFollower):
            served.run()
            return
        for lora, path in (loras or {}).items():
            if isinstance(served, Embedder):
                raise UserError("--lora-modules: an embedding artifact serves no LoRA adapters")
            served.adapters.add(lora, path)
        loaded = f"{len(served.runtime.loaded)} graphs" if preload else "graphs load on first use"
        log.info("opened %s in %.1f s (%s)", directory, time.perf_counter() - start, loaded)
        access = access or ServerAccess.for_bind(host, None, False, ())
        name = model_name or str(directory)
        serve(served, taken or listen(host, port), host, name, limits, shutdown_timeout, access, admin)


def serve(
    engine: LLMEngine | Embedder, sock: socket.socket, host: str, model_name: str, limits: ServerLimits,
    shutdown_timeout: float, access: ServerAccess, admin: AdminOptions = NO_ADMIN,
) -> None:
    """Serve ``engine`` on ``sock`` (bound to ``host``) until a signal, or a lost rank, ends it."""
    app = create_app(engine, model_name, limits, access, admin)
    port = sock.getsockname()[1]  # the port taken, when 0 asked for any
    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout, http=HeaderTimeoutH11
    )
    logging.getLogger("asyncio").addFilter(QuietAcceptErrors())
    address = f"[{host}]" if sock.family == socket.AF_INET6 else host
    if access.api_key is None and not is_loopback(host):
        log.warning("serving on %s without --api-key: anyone who can reach it may generate", host)
    log.info("serving %r at %s (CTRL+C to quit)", model_name, f"http://{address}:{port}")
    server = uvicorn.Server(config)
    stopped: list[str] = []

    def fatal(why: str) -> None:  # the engine can never step again: end the server
        stopped.append(why)
        server.should_exit = True

    if isinstance(engine, LLMEngine):
        app.state.engine_loop.on_fatal = fatal
    with sock:
        server.run(sockets=[sock])
    engine.runtime.close()
    if stopped:
        raise UserError(f"the engine stopped: {stopped[0]}")
