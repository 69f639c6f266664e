"""Moving a serving engine to the newest complete manifest version, between two steps.

``nb replan`` writes a new version beside the old (``artifact/manifest_versions.py``). A reload
reads the newest complete one off the engine thread, then hands the engine thread one command
that swaps the bucket set between two steps (``LLMEngine.use_manifest``): the geometry is the
same, so the KV cache, the prefix cache and every running request with its blocks carry on, and
no request waits on a compile (the graphs are compiled already; a new one loads on first use).
A version the engine refuses leaves the old one serving, and says why in the log and ``/metrics``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from neuron_buckets.artifact.manifest_versions import newest_complete
from neuron_buckets.server.engine_loop import EngineLoop

log = logging.getLogger("uvicorn.error")  # the server's own log, which nb serve shows
SWAP_TIMEOUT_S = 600.0  # a step never takes this long; a dead loop never answers


@dataclass(frozen=True)
class Reload:
    version: int  # the version serving now
    swapped: bool  # whether this reload moved to it
    token_buckets: tuple[int, ...]

    def to_json(self) -> dict:
        return {"version": self.version, "swapped": self.swapped, "token_buckets": list(self.token_buckets)}


class ManifestReloader:
    def __init__(self, loop: EngineLoop, registry: CollectorRegistry, model_name: str) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.directory = self.engine.runtime.directory
        self._lock = threading.Lock()  # one reload at a time (a route, SIGHUP, the re-plan timer)
        labels = ["model_name"]
        self.version = Gauge("nb:manifest_version", "The manifest version serving (1: manifest.json)",
                             labels, registry=registry).labels(model_name)
        self.swaps = Counter("nb:manifest_swaps", "Moves to a newer manifest version while serving", labels,
                             registry=registry).labels(model_name)
        self.refusals = Counter("nb:manifest_swap_failures", "Manifest versions the engine refused",
                                labels, registry=registry).labels(model_name)
        version, manifest = newest_complete(self.directory)
        self.version.set(version if manifest.buckets == self.engine.runtime.manifest.buckets else 0)

    def token_buckets(self) -> tuple[int, ...]:
        return tuple(b.seq for b in self.engine.runtime.buckets.prefill)

    def reload(self) -> Reload:
        """Move to the newest complete version if its buckets differ from those serving."""
        with self._lock:
            version, manifest = newest_complete(self.directory)
            if manifest.buckets == self.engine.runtime.manifest.buckets:
                self.version.set(version)
                return Reload(version, False, self.token_buckets())
            try:
                self.loop.between_steps(lambda: self.engine.use_manifest(manifest)).result(SWAP_TIMEOUT_S)
            except Exception as e:
                self.refusals.inc()
                log.error("manifest version %d not served, the old buckets go on: %s", version, e)
                raise
            self.version.set(version)
            self.swaps.inc()
            log.info("serving manifest version %d: token buckets %s", version, list(self.token_buckets()))
            return Reload(version, True, self.token_buckets())

    def reload_quietly(self) -> None:
        """``reload`` for a signal or a timer: a refusal is logged (and counted), never raised."""
        try:
            self.reload()
        except Exception:  # logged by reload when the engine refused; anything else here
            log.exception("reloading the manifest failed")
