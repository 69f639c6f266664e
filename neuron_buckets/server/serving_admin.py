"""The server's admin routes and what runs beside its engine loop: the trace it records, reloads
of the newest manifest version, and the re-plan timer.

``GET /admin/trace`` returns the rolling trace of what the server served (JSONL, no text: see
``trace_recorder.py``), the file ``nb replan --trace`` reads; ``POST /admin/reload`` moves to the
newest complete manifest version, as SIGHUP does. Both sit behind ``--api-key`` like ``/v1``. With
``--record-trace FILE`` the trace is written there at every re-plan and at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from neuron_buckets.server.access import ServerAccess
from neuron_buckets.server.engine_loop import EngineLoop
from neuron_buckets.server.manifest_reloader import ManifestReloader
from neuron_buckets.server.metrics import ServerMetrics
from neuron_buckets.server.replan_timer import ReplanSchedule, ReplanTimer

log = logging.getLogger("uvicorn.error")  # the server's own log, which nb serve shows


@dataclass(frozen=True)
class AdminOptions:
    record_trace: Path | None = None  # written at every re-plan and at shutdown
    replan: ReplanSchedule | None = None  # None: no background re-plans


class ServingAdmin:
    """The admin side of one server: built with its app, started and stopped by its lifespan."""

    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, options: AdminOptions) -> None:
        self.loop, self.options = loop, options
        self.reloader = ManifestReloader(loop, metrics.registry, metrics.model_name)
        self.timer = None
        if options.replan is not None:
            schedule = options.replan
            if options.record_trace is not None and schedule.trace_file is None:
                schedule = ReplanSchedule(schedule.every_s, schedule.budget_s, options.record_trace)
            registry, name = metrics.registry, metrics.model_name
            self.timer = ReplanTimer(schedule, loop.trace, self.reloader, registry, name)

    def start(self) -> None:
        """Start the re-plan timer, and reload on SIGHUP where this is the main thread (a server
        run on another thread, in tests, has no signals)."""
        if self.timer is not None:
            self.timer.start()
        if threading.current_thread() is threading.main_thread():
            loop, reload = asyncio.get_running_loop(), self.reloader.reload_quietly
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.run_in_executor(None, reload))

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.stop()
        if (path := self.options.record_trace) is not None:
            count = self.loop.trace.write(path)
            log.info("wrote the trace of %d requests to %s", count, path)

    def routes(self, app: FastAPI, access: ServerAccess) -> None:
        admin = APIRouter(prefix="/admin", dependencies=[Depends(access.check_key)])

        @admin.get("/trace")
        async def trace() -> Response:
            return Response(self.loop.trace.jsonl(), media_type="application/x-ndjson")

        @admin.post("/reload")
        async def reload() -> JSONResponse:
            return JSONResponse((await asyncio.to_thread(self.reloader.reload)).to_json())

        app.include_router(admin)
