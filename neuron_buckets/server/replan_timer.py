"""``nb serve --replan-every``: re-plan the buckets on the traffic served, now and then, and swap.

Every ``every_s`` seconds a thread writes the recorded trace to a file and runs ``nb replan`` on
it as a child process at the lowest CPU priority (its compile workers too): planning and
compiling never run in the serving process, and take only the CPU the server leaves idle. When
the child writes a new manifest version, the server moves to it between two steps
(``manifest_reloader.py``). Each run's outcome and reason go to the log and ``/metrics``
(``nb:replan_runs`` by outcome); a failed compile leaves the old buckets serving.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Info

from neuron_buckets.server.manifest_reloader import ManifestReloader
from neuron_buckets.server.trace_recorder import TraceRecorder

log = logging.getLogger("uvicorn.error")  # the server's own log, which nb serve shows
LOWEST_PRIORITY = 19


@dataclass(frozen=True)
class ReplanSchedule:
    every_s: float
    budget_s: float
    trace_file: Path | None = None  # where the trace is written for the child (default: a temp file)


class ReplanTimer:
    def __init__(self, schedule: ReplanSchedule, trace: TraceRecorder, reloader: ManifestReloader,
                 registry: CollectorRegistry, model_name: str) -> None:
        self.schedule, self.trace, self.reloader = schedule, trace, reloader
        self.runs = Counter("nb:replan_runs", "Background re-plans by outcome", ["model_name", "outcome"],
                            registry=registry)
        self.last = Info("nb:replan_last", "The last re-plan's outcome and why", ["model_name"],
                         registry=registry).labels(model_name)
        self.model_name = model_name
        self._stop = threading.Event()
        self._child: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, name="nb-replan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if (child := self._child) is not None and child.poll() is None:
            child.terminate()
        self._thread.join()

    def _run(self) -> None:
        """A re-plan every ``every_s`` seconds, when requests were served since the last one (the
        same trace would plan the same set again)."""
        planned_at = 0
        while not self._stop.wait(self.schedule.every_s):
            if self.trace.served > planned_at:
                planned_at = self.trace.served
                self.run_once()

    def run_once(self) -> dict:
        """One re-plan on the trace so far, and a swap when it wrote a new version; its report."""
        with tempfile.TemporaryDirectory(prefix="nb-replan-") as tmp:
            path = self.schedule.trace_file or Path(tmp) / "trace.jsonl"
            self.trace.write(path)
            report = self._replan(path)
        outcome = report.get("outcome", "error")
        reason = str(report.get("reason"))
        self.runs.labels(self.model_name, outcome).inc()
        self.last.info({"outcome": outcome, "reason": reason})
        (log.error if outcome in ("failed", "error") else log.info)("re-plan: %s: %s", outcome, reason)
        if outcome == "new_version":
            self.reloader.reload_quietly()
        return report

    def _replan(self, trace: Path) -> dict:
        """``nb replan --json`` in a child process at nice 19; its report (outcome "error" with the
        child's last line when it printed none)."""
        command = [sys.executable, "-m", "neuron_buckets.cli", "replan", str(self.reloader.directory),
                   "--trace", str(trace), "--budget-s", str(self.schedule.budget_s), "--json"]
        self._child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       preexec_fn=lambda: os.nice(LOWEST_PRIORITY))
        out, err = self._child.communicate()
        try:
            return json.loads(out)
        except ValueError:
            last = (err.strip().splitlines() or [f"exit status {self._child.returncode}"])[-1]
            return {"outcome": "error", "reason": last}
