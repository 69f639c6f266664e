"""``nb serve``: the OpenAI-compatible server over an artifact directory.

The web stack (FastAPI, uvicorn, prometheus_client) is the optional ``serve`` extra: a machine
that only compiles never needs it, so it is imported here, when the command runs, and its
absence is one line saying what to install.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from neuron_buckets.cli.generate import DRAFT_HELP, SPECULATIVE_HELP, ConfigOpt, speculative_config
from neuron_buckets.config.model import POOLINGS
from neuron_buckets.utils.errors import UserError

SERVE_EXTRA = {"fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic"}
API_KEY_ENV = "NB_API_KEY"


def serve(
    directory: Annotated[Path, typer.Argument(help="Artifact directory")],
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free port)")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model name clients send (default: DIRECTORY as given)")
    ] = None,
    max_open_requests: Annotated[
        int, typer.Option(min=1, help="Requests queued and running together; more get HTTP 429")
    ] = 256,
    max_body_bytes: Annotated[
        int, typer.Option(min=1, help="Largest request body in bytes; larger get HTTP 413")
    ] = 1 << 20,
    speculative_ngram: Annotated[int, typer.Option(min=0, help=SPECULATIVE_HELP)] = 0,
    speculative_draft: Annotated[int, typer.Option(min=0, help=DRAFT_HELP)] = 0,
    config: ConfigOpt = None,
    shutdown_timeout: Annotated[
        float, typer.Option(min=0, help="Seconds open requests may take to finish after SIGTERM")
    ] = 30.0,
    api_key: Annotated[
        str | None,
        typer.Option(envvar=API_KEY_ENV, show_default=False,
                     help="Require 'Authorization: Bearer KEY' on every /v1 route (env NB_API_KEY)"),
    ] = None,
    key_metrics: Annotated[bool, typer.Option(help="Require the API key on /metrics too")] = False,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            metavar="HOST", help="A Host name clients may use besides the loopback names (repeatable)"
        ),
    ] = None,
    preload: Annotated[
        bool,
        typer.Option(
            "--preload",
            help="Load every graph before serving: start-up then takes as long as loading them all, "
            "and no bucket's first request waits for its pieces to load",
        ),
    ] = False,
    pooling: Annotated[
        str | None,
        typer.Option(help="An embedding artifact's pooling: last (token) or mean (default: as compiled)"),
    ] = None,
) -> None:
    """Serve an artifact directory over the OpenAI API: completions, chat, /health, /metrics; an
    embedding artifact: /v1/embeddings."""
    try:
        from neuron_buckets.server.access import ServerAccess
        from neuron_buckets.server.api_server import ServerLimits, run_server
    except ModuleNotFoundError as e:
        if e.name not in SERVE_EXTRA:
            raise
        raise UserError(f"nb serve needs {e.name}: pip install 'neuron-buckets[serve]'") from None
    if api_key is None and os.environ.get(API_KEY_ENV) == "":  # click reads an empty variable as unset
        api_key = ""
    if key_metrics and api_key is None:
        raise UserError("--key-metrics needs --api-key (or NB_API_KEY)")
    limits = ServerLimits(max_open_requests=max_open_requests, max_body_bytes=max_body_bytes)
    speculative = speculative_config(speculative_ngram, speculative_draft, config)
    access = ServerAccess.for_bind(host, api_key, key_metrics, tuple(allowed_host or ()))
    if pooling not in (None, *POOLINGS):
        raise UserError(f"--pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    run_server(
        directory, host, port, served_model_name, limits, shutdown_timeout, speculative, access, preload,
        pooling,
    )


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``nb`` app."""
    app.command("serve", short_help="Serve an artifact over the OpenAI API.")(serve)
