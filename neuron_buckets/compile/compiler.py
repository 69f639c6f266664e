"""``nb compile``: config -> grid -> three pieces per bucket -> artifact directory.

Each bucket runs as an embed piece, one decoder-layer piece called once per layer, and a head
piece (``model/pieces.py``); pieces that buckets share are compiled once. Only pieces whose key
is in neither the artifact directory nor the shared cache are compiled, each in a worker process
(``--jobs``). After every finished piece the manifest is rewritten atomically, so a kill at any
moment loses at most the pieces still compiling, and the next run resumes with exactly those. A
failing piece is recorded with its error and log (its buckets fail); the rest go on.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from neuron_buckets import __version__
from neuron_buckets.artifact.manifest import (
    GRAPHS,
    WEIGHTS,
    BackendInfo,
    BucketRecord,
    CacheGeometry,
    DecodeInfo,
    Manifest,
    ModelInfo,
    PieceRecord,
    WeightsInfo,
    atomic_write,
    sha256_file,
    write_manifest,
)
from neuron_buckets.backends import BackendUnavailable, get_backend
from neuron_buckets.compile.cache_key import graph_key, source_digest
from neuron_buckets.compile.output_dir import check_owned, owned_directory, prune
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.text_files import eos_token_ids, text_sources, write_text_files
from neuron_buckets.compile.worker import compile_piece, init_worker
from neuron_buckets.config import Config, enumerate_grid
from neuron_buckets.config.memory import check_compile_memory
from neuron_buckets.model.checkpoint import build_model, model_config_of, save_weights, weights_fingerprint
from neuron_buckets.model.llama import LlamaConfig
from neuron_buckets.model.pieces import PieceShape, bucket_pieces


@dataclass
class Outcome:
    """One piece's result, as it goes into the manifest."""

    shape: PieceShape
    key: str
    status: str = "ok"
    compile_seconds: float = 0.0
    cached: bool = False
    error: str | None = None
    log: str | None = None
    sha256: str | None = None  # of the placed graph, hashed once: the manifest is rewritten often

    @property
    def name(self) -> str:
        return self.shape.name


@dataclass
class CompileReport:
    out: Path
    outcomes: list[Outcome] = field(default_factory=list)
    buckets: list[BucketRecord] = field(default_factory=list)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != "ok"]

    @property
    def compiled(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "ok" and not o.cached]


def cache_geometry(model: LlamaConfig, config: Config) -> CacheGeometry:
    c = config.cache
    return CacheGeometry(
        block_size=c.block_size,
        num_blocks=c.num_blocks,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=c.dtype,
        max_model_len=c.max_model_len,
    )


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
        self.text_sources = text_sources(config.model.path)
        self.eos_token_ids = eos_token_ids(config.model.path, self.model_config.vocab_size)
        self.buckets = enumerate_grid(config)
        check_compile_memory(config, self.model_config)
        self.bucket_pieces = {b: bucket_pieces(b, self.backend.dynamic_shapes) for b in self.buckets}
        self.shapes = sorted({s for pieces in self.bucket_pieces.values() for s in pieces.values()})
        backend_info = BackendInfo(
            name=self.backend.name,
            device=config.compile.device,
            versions=self.backend.versions(),
            flags=self.backend.resolved_flags(config.compile.flags),
        )
        self.manifest = Manifest(
            toolchain={"name": "neuron-buckets", "version": __version__},
            backend=backend_info,
            model=ModelInfo(
                source=str(config.model.path) if config.model.path else "embedded-default",
                config=self.model_config.to_hf(),
                dtype=config.cache.dtype,
            ),
            cache=cache_geometry(self.model_config, config),
            decode=DecodeInfo(
                speculation_length=config.buckets.speculation_length,
                max_num_seqs=config.buckets.max_num_seqs,
                max_num_batched_tokens=config.buckets.max_num_batched_tokens,
            ),
        )
        sources = source_digest(extra=(Path(sys.modules[type(self.backend).__module__].__file__),))
        self.keys = {
            s: graph_key(
                piece=s,
                model_config=self.manifest.model.config,
                cache=asdict(self.manifest.cache),
                backend=asdict(backend_info),
                sources=sources,
            )
            for s in self.shapes
        }

    def graph_file(self, key: str) -> Path:
        return self.out / GRAPHS / f"{key}.{self.backend.graph_ext}"

    def _intact(self, old: Manifest | None) -> dict[str, PieceRecord]:
        """Pieces of the last run whose graph file is still intact, by key."""
        intact: dict[str, PieceRecord] = {}
        for key, rec in old.pieces.items() if old else ():
            path = self.out / rec.file
            if rec.status == "ok" and path.is_file() and sha256_file(path) == rec.sha256:
                intact[key] = rec
        return intact

    def _write_weights(self, old: Manifest | None) -> None:
        """Write the one weights file, unless the last run wrote it from the same source and its
        bytes are intact (one hash: a damaged file is rewritten, not carried into the manifest)."""
        path = self.out / WEIGHTS
        dtype = getattr(torch, self.config.cache.dtype)
        fingerprint = weights_fingerprint(self.config.model.path, dtype)
        kept = old.weights if old else None
        if (
            kept is not None
            and kept.source_fingerprint == fingerprint
            and path.is_file()
            and path.stat().st_size == kept.bytes
            and sha256_file(path) == kept.sha256
        ):
            self.manifest.weights = kept
            return
        model = build_model(self.config.model.path, dtype)
        atomic_write(path, lambda p: save_weights(model, p))
        self.manifest.weights = WeightsInfo(WEIGHTS, sha256_file(path), path.stat().st_size, fingerprint)

    def _record(self, o: Outcome) -> PieceRecord:
        path = self.graph_file(o.key)
        ok = o.status == "ok"
        return PieceRecord(
            role=o.shape.role,
            name=o.name,
            file=path.relative_to(self.out).as_posix(),
            sha256=o.sha256,
            bytes=path.stat().st_size if ok else 0,
            compile_seconds=round(o.compile_seconds, 3),
            cached=o.cached,
            status=o.status,
            error=o.error,
            log=o.log,
        )

    def _bucket_records(self, done: dict[PieceShape, Outcome]) -> list[BucketRecord]:
        """Every bucket whose pieces are all finished (ok when all three are), or that has a
        failed piece already, so that a run stopped by --fail-fast still records it."""
        records = []
        for b in self.buckets:
            pieces = self.bucket_pieces[b]
            finished = [done[s] for s in pieces.values() if s in done]
            failed = [o for o in finished if o.status != "ok"]
            if len(finished) < len(pieces) and not failed:
                continue
            error = f"{failed[0].name}: {failed[0].error}" if failed else None
            records.append(BucketRecord(
                b.kind, b.batch, b.seq, b.ctx, {role: self.keys[s] for role, s in pieces.items()},
                "failed" if failed else "ok", error,
            ))
        return records

    def _save(self, done: dict[PieceShape, Outcome]) -> None:
        """Rewrite the manifest with every piece and bucket finished so far (atomic)."""
        self.manifest.created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.manifest.pieces = {o.key: self._record(o) for s in self.shapes if (o := done.get(s))}
        self.manifest.buckets = self._bucket_records(done)
        if self.manifest.buckets:
            write_manifest(self.out, self.manifest)

    def _finish(self, o: Outcome, err: str | None) -> Outcome:
        if err is None:
            self.store.place(self.store.path(o.key, self.backend.graph_ext), self.graph_file(o.key))
            o.sha256 = sha256_file(self.graph_file(o.key))
            return o
        log = self.out / "logs" / f"{o.name}.log"
        atomic_write(log, lambda p: p.write_text(err))
        last = err.strip().splitlines()[-1]
        o.status, o.error, o.log = "failed", last, log.relative_to(self.out).as_posix()
        return o

    def run(self, jobs: int, on_event: Callable[[str, Outcome | None], None] | None = None) -> CompileReport:
        """Compile the pieces that are missing; ``on_event`` sees ("queued"|"done", outcome).

        "queued" comes when a piece is handed to a worker, at most ``jobs`` at a time, so queued
        minus done is what is compiling.
        """
        notify = on_event or (lambda *_: None)
        with owned_directory(self.out) as old:
            self.store.remove_stale_temps()
            previous = self._intact(old)
            self._write_weights(old)
            self.manifest.text = write_text_files(self.text_sources, self.out, self.eos_token_ids)
            done: dict[PieceShape, Outcome] = {}
            todo: list[Outcome] = []
            for s in self.shapes:
                key = self.keys[s]
                if key in previous:
                    rec = previous[key]
                    secs, sha = rec.compile_seconds, rec.sha256
                    done[s] = Outcome(s, key, compile_seconds=secs, cached=True, sha256=sha)
                elif self.store.get(key, self.backend.graph_ext):
                    secs = self.store.compile_seconds(key, self.backend.graph_ext)
                    done[s] = self._finish(Outcome(s, key, compile_seconds=secs, cached=True), None)
                else:
                    todo.append(Outcome(s, key))
            self._save(done)
            for o in done.values():
                notify("done", o)
            if todo:
                self._compile_all(todo, done, jobs, notify)
            ok = [self.graph_file(o.key) for o in done.values() if o.status == "ok"]
            keep = {f.relative_to(self.out).as_posix() for f in ok} | set(self.manifest.text.files)
            prune(self.out, old, keep)
            return CompileReport(self.out, [done[s] for s in self.shapes if s in done], self.manifest.buckets)

    def _compile_all(self, todo: list[Outcome], done: dict[PieceShape, Outcome], jobs: int, notify) -> None:
        """Compile ``todo``, at most ``jobs`` at a time, so that ``--fail-fast`` starts nothing more.

        A worker that dies (OOM kill, segfault) breaks its pool and fails the pieces then in
        flight; a fresh pool compiles the rest.
        """
        queue = deque(todo)
        threads = max(1, (os.cpu_count() or 1) // max(jobs, 1))
        spawn = {"mp_context": mp.get_context("spawn"), "initializer": init_worker, "initargs": (threads,)}
        while queue and not (self.fail_fast and any(o.status != "ok" for o in done.values())):
            with ProcessPoolExecutor(jobs, **spawn) as pool:
                self._drain(pool, queue, done, jobs, notify)

    def _drain(
        self, pool: ProcessPoolExecutor, queue: deque[Outcome], done: dict[PieceShape, Outcome], jobs: int,
        notify,
    ) -> None:
        """Feed ``pool`` until the queue is empty, a piece fails under fail-fast, or the pool breaks."""
        running: dict[Future, Outcome] = {}
        feeding = True
        while running or (feeding and queue):
            while feeding and queue and len(running) < jobs:
                o = queue.popleft()
                running[pool.submit(compile_piece, self.config, o.shape, o.key, str(self.store.root))] = o
                notify("queued", o)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                o = running.pop(fut)
                try:
                    o.compile_seconds, err = fut.result()
                except Exception as e:  # the worker could not run it, or died (BrokenProcessPool)
                    err = traceback.format_exc()
                    feeding = feeding and not isinstance(e, BrokenProcessPool)
                done[o.shape] = self._finish(o, err)
                self._save(done)
                notify("done", o)
                feeding = feeding and not (err and self.fail_fast)
