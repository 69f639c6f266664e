"""``nb compile``: config -> grid -> one graph per bucket -> artifact directory.

Only buckets whose key is in neither the artifact directory nor the shared cache are compiled,
each in a worker process (``--jobs``). After every finished bucket the manifest is rewritten
atomically, so a kill at any moment loses at most the graphs still compiling, and the next run
resumes with exactly those. A failing bucket is recorded with its error and log; the rest go on.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import sys
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from neuron_buckets import __version__
from neuron_buckets.artifact.manifest import (
    GRAPHS,
    SCHEMA_VERSION,
    WEIGHTS,
    atomic_write,
    sha256_file,
    write_manifest,
)
from neuron_buckets.backends import BackendUnavailable, get_backend
from neuron_buckets.compile.cache_key import graph_key, source_digest
from neuron_buckets.compile.output_dir import check_owned, owned_directory, prune
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.worker import compile_bucket, init_worker
from neuron_buckets.config import Config, enumerate_grid
from neuron_buckets.config.memory import check_compile_memory
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.checkpoint import build_model, model_config_of, save_weights, weights_fingerprint
from neuron_buckets.model.llama import LlamaConfig


@dataclass
class Outcome:
    """One bucket's result, as it goes into the manifest."""

    bucket: Bucket
    key: str
    status: str = "ok"
    compile_seconds: float = 0.0
    cached: bool = False
    error: str | None = None
    log: str | None = None
    sha256: str | None = None  # of the placed graph, hashed once: the manifest is rewritten often


@dataclass
class CompileReport:
    out: Path
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != "ok"]

    @property
    def compiled(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "ok" and not o.cached]


def cache_geometry(model: LlamaConfig, config: Config) -> dict[str, Any]:
    c = config.cache
    return {
        "block_size": c.block_size,
        "num_blocks": c.num_blocks,
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "dtype": c.dtype,
        "max_model_len": c.max_model_len,
    }


class Compiler:
    def __init__(self, config: Config, out: Path, cache_dir: Path, fail_fast: bool = False) -> None:
        self.config, self.out, self.fail_fast = config, Path(out), fail_fast
        check_owned(self.out)  # a directory that is not ours is refused before anything starts
        self.backend = get_backend(config.compile.backend)
        ok, why = self.backend.available()
        if not ok:
            raise BackendUnavailable(f"backend {self.backend.name!r} is not usable here: {why}")
        self.store = GraphStore(cache_dir)
        self.model_config = model_config_of(config.model.path)
        self.buckets = enumerate_grid(config)
        check_compile_memory(config, self.model_config)
        backend_info = {
            "name": self.backend.name,
            "device": config.compile.device,
            "versions": self.backend.versions(),
            "flags": self.backend.resolved_flags(config.compile.flags),
        }
        self.manifest: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "toolchain": {"name": "neuron-buckets", "version": __version__},
            "backend": backend_info,
            "model": {
                "source": str(config.model.path) if config.model.path else "embedded-default",
                "config": self.model_config.to_hf(),
                "dtype": config.cache.dtype,
            },
            "cache": cache_geometry(self.model_config, config),
            "decode": {
                "speculation_length": config.buckets.speculation_length,
                "max_num_seqs": config.buckets.max_num_seqs,
                "max_num_batched_tokens": config.buckets.max_num_batched_tokens,
            },
        }
        sources = source_digest(extra=(Path(sys.modules[type(self.backend).__module__].__file__),))
        self.keys = {
            b: graph_key(
                bucket=b,
                model_config=self.manifest["model"]["config"],
                cache=self.manifest["cache"],
                backend=backend_info,
                sources=sources,
            )
            for b in self.buckets
        }

    def graph_file(self, key: str) -> Path:
        return self.out / GRAPHS / f"{key}.{self.backend.graph_ext}"

    def _intact(self, old: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
        """Records of the last run whose graph file is still intact, by key."""
        intact: dict[str, dict[str, Any]] = {}
        for rec in old["buckets"] if old else ():
            path = self.out / rec["file"]
            if rec["status"] == "ok" and path.is_file() and sha256_file(path) == rec["sha256"]:
                intact[rec["key"]] = rec
        return intact

    def _write_weights(self, old: dict[str, Any] | None) -> None:
        """Write the one weights file, unless the last run wrote it from the same source and its
        bytes are intact (one hash: a damaged file is rewritten, not carried into the manifest)."""
        path = self.out / WEIGHTS
        dtype = getattr(torch, self.config.cache.dtype)
        fingerprint = weights_fingerprint(self.config.model.path, dtype)
        kept = old["weights"] if old else {}
        if (
            kept.get("source_fingerprint") == fingerprint
            and path.is_file()
            and path.stat().st_size == kept["bytes"]
            and sha256_file(path) == kept["sha256"]
        ):
            self.manifest["weights"] = kept
            return
        model = build_model(self.config.model.path, dtype)
        atomic_write(path, lambda p: save_weights(model, p))
        info = {"file": WEIGHTS, "sha256": sha256_file(path), "bytes": path.stat().st_size}
        self.manifest["weights"] = {**info, "source_fingerprint": fingerprint}

    def _record(self, o: Outcome) -> dict[str, Any]:
        path = self.graph_file(o.key)
        ok = o.status == "ok"
        return {
            "kind": o.bucket.kind,
            "batch": o.bucket.batch,
            "seq": o.bucket.seq,
            "ctx": o.bucket.ctx,
            "key": o.key,
            "file": path.relative_to(self.out).as_posix(),
            "sha256": o.sha256,
            "bytes": path.stat().st_size if ok else 0,
            "compile_seconds": round(o.compile_seconds, 3),
            "cached": o.cached,
            "status": o.status,
            "error": o.error,
            "log": o.log,
        }

    def _save(self, done: dict[Bucket, Outcome]) -> None:
        """Rewrite the manifest with every bucket finished so far (atomic)."""
        self.manifest["created"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.manifest["buckets"] = [self._record(done[b]) for b in self.buckets if b in done]
        if self.manifest["buckets"]:
            write_manifest(self.out, self.manifest)

    def _finish(self, o: Outcome, err: str | None) -> Outcome:
        if err is None:
            self.store.place(self.store.path(o.key, self.backend.graph_ext), self.graph_file(o.key))
            o.sha256 = sha256_file(self.graph_file(o.key))
            return o
        log = self.out / "logs" / f"{o.bucket.name}.log"
        atomic_write(log, lambda p: p.write_text(err))
        last = err.strip().splitlines()[-1]
        o.status, o.error, o.log = "failed", last, log.relative_to(self.out).as_posix()
        return o

    def run(self, jobs: int, on_event: Callable[[str, Outcome | None], None] | None = None) -> CompileReport:
        """Compile what is missing; ``on_event`` sees ("queued"|"done", outcome) for a progress bar.

        "queued" comes when a bucket is handed to a worker, at most ``jobs`` at a time, so queued
        minus done is what is compiling.
        """
        notify = on_event or (lambda *_: None)
        with owned_directory(self.out) as old:
            self.store.remove_stale_temps()
            previous = self._intact(old)
            self._write_weights(old)
            done: dict[Bucket, Outcome] = {}
            todo: list[Outcome] = []
            for b in self.buckets:
                key = self.keys[b]
                if key in previous:
                    rec = previous[key]
                    done[b] = Outcome(
                        b, key, compile_seconds=rec["compile_seconds"], cached=True, sha256=rec["sha256"]
                    )
                elif self.store.get(key, self.backend.graph_ext):
                    secs = self.store.compile_seconds(key, self.backend.graph_ext)
                    done[b] = self._finish(Outcome(b, key, compile_seconds=secs, cached=True), None)
                else:
                    todo.append(Outcome(b, key))
            self._save(done)
            for o in done.values():
                notify("done", o)
            if todo:
                self._compile_all(todo, done, jobs, notify)
            ok = [self.graph_file(o.key) for o in done.values() if o.status == "ok"]
            prune(self.out, old, {f.relative_to(self.out).as_posix() for f in ok})
            return CompileReport(self.out, [done[b] for b in self.buckets if b in done])

    def _compile_all(self, todo: list[Outcome], done: dict[Bucket, Outcome], jobs: int, notify) -> None:
        """Compile ``todo``, at most ``jobs`` at a time, so that ``--fail-fast`` starts nothing more.

        A worker that dies (OOM kill, segfault) breaks its pool and fails the buckets then in
        flight; a fresh pool compiles the rest.
        """
        queue = deque(todo)
        threads = max(1, (os.cpu_count() or 1) // max(jobs, 1))
        spawn = {"mp_context": mp.get_context("spawn"), "initializer": init_worker, "initargs": (threads,)}
        while queue and not (self.fail_fast and any(o.status != "ok" for o in done.values())):
            with ProcessPoolExecutor(jobs, **spawn) as pool:
                self._drain(pool, queue, done, jobs, notify)

    def _drain(
        self, pool: ProcessPoolExecutor, queue: deque[Outcome], done: dict[Bucket, Outcome], jobs: int, notify
    ) -> None:
        """Feed ``pool`` until the queue is empty, a bucket fails under fail-fast, or the pool breaks."""
        running: dict[Future, Outcome] = {}
        feeding = True
        while running or (feeding and queue):
            while feeding and queue and len(running) < jobs:
                o = queue.popleft()
                running[pool.submit(compile_bucket, self.config, o.bucket, o.key, str(self.store.root))] = o
                notify("queued", o)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                o = running.pop(fut)
                try:
                    o.compile_seconds, err = fut.result()
                except Exception as e:  # the worker could not run it, or died (BrokenProcessPool)
                    err = traceback.format_exc()
                    feeding = feeding and not isinstance(e, BrokenProcessPool)
                done[o.bucket] = self._finish(o, err)
                self._save(done)
                notify("done", o)
                feeding = feeding and not (err and self.fail_fast)
