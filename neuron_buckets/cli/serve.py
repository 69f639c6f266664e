"""``nb serve``: the OpenAI-compatible server over an artifact directory.

The web stack (FastAPI, uvicorn, prometheus_client) is the optional ``serve`` extra: a machine
that only compiles never needs it, so it is imported here, when the command runs, and its
absence is one line saying what to install.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

import typer

from neuron_buckets.cli.generate import DRAFT_HELP, SPECULATIVE_HELP, ConfigOpt, speculative_config
from neuron_buckets.cli.lora_option import lora_modules
from neuron_buckets.config.model import POOLINGS
from neuron_buckets.utils.errors import UserError

DURATION = re.compile(r"(\d+(?:\.\d+)?)([smh]?)")
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
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
                     help="Require 'Authorization: Bearer KEY' on /v1 and /admin routes (env NB_API_KEY)"),
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
    record_trace: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Write the trace of what was served (no text) here at every "
                     "re-plan and at shutdown; /admin/trace returns it any time"),
    ] = None,
    replan_every: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="Re-plan the token buckets on the traffic served this often "
                     "(e.g. 30m, 2h, 90s) and move to a better set once compiled"),
    ] = None,
    lora_module: Annotated[
        list[str] | None,
        typer.Option("--lora-modules", metavar="NAME=PATH",
                     help="A LoRA adapter (a PEFT directory) a request's model may name; repeatable"),
    ] = None,
    replan_budget_s: Annotated[
        float, typer.Option(min=0.0, help="Most seconds a re-plan's new pieces may take to compile")
    ] = 600.0,
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
    from neuron_buckets.server.replan_timer import ReplanSchedule
    from neuron_buckets.server.serving_admin import AdminOptions

    every = None if replan_every is None else duration_s("--replan-every", replan_every)
    schedule = None if every is None else ReplanSchedule(every, replan_budget_s)
    run_server(
        directory, host, port, served_model_name, limits, shutdown_timeout, speculative, access, preload,
        pooling, AdminOptions(record_trace, schedule), lora_modules("--lora-modules", lora_module),
    )


def duration_s(option: str, text: str) -> float:
    """'90s', '30m', '2h' or a bare number of seconds, in seconds (more than 0)."""
    match = DURATION.fullmatch(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise UserError(f"{option}: {text!r} is not a duration such as 90s, 30m or 2h")
    return float(match.group(1)) * UNITS[match.group(2) or "s"]


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``nb`` app."""
    app.command("serve", short_help="Serve an artifact over the OpenAI API.")(serve)
