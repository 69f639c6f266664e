"""``nb compile``: config -> grid -> three pieces per bucket -> artifact directory.

Each bucket runs as an embed piece, one decoder-layer piece called once per layer, and a head
piece (``model/pieces.py``); pieces that buckets share are compiled once. Only pieces whose key
is in neither the artifact directory nor the graph cache (local, or remote and pulled) are
compiled, by an executor: local worker processes (``--jobs``) or Ray tasks. Both go through one
loop here: after every finished piece the manifest is rewritten atomically, so a kill at any
moment loses at most the pieces still compiling, and the next run resumes with exactly those. A
failing piece is recorded with its error and log (its buckets fail); the rest go on. A piece
whose worker died is compiled again, ``compile.retries`` times, then recorded as failed.

With a draft model (``[speculative] method = "draft_model"``) a second compiler builds the draft's
sub-artifact, ``<out>/draft/``, from ``config/draft.py``'s config, after the target and under the
target's lock: the same pipeline, its own manifest, weights and buckets, its pieces keyed and
cached like any other (a draft with the target's shapes reuses the target's prefill graphs).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from neuron_buckets import __version__
from neuron_buckets.artifact.manifest import (
    GRAPHS,
    KERNELS,
    WEIGHTS,
    BackendInfo,
    BucketRecord,
    CacheGeometry,
    DecodeInfo,
    LibraryInfo,
    Manifest,
    ModelInfo,
    PieceRecord,
    WeightsInfo,
    atomic_write,
    sha256_file,
    write_manifest,
)
from neuron_buckets.backends import BackendUnavailable, get_backend
from neuron_buckets.compile.cache_key import backend_source_digest, graph_key
from neuron_buckets.compile.executor import PieceExecutor, Submit
from neuron_buckets.compile.graph_cache import GraphCache, Hit
from neuron_buckets.compile.output_dir import check_owned, owned_directory, prune
from neuron_buckets.compile.store_entry import StoreEntry
from neuron_buckets.compile.text_files import eos_token_ids, text_sources, write_text_files
from neuron_buckets.compile.worker import CompileTask, Toolchain
from neuron_buckets.config import Config, ConfigError, enumerate_grid
from neuron_buckets.config.draft import DRAFT, draft_config
from neuron_buckets.config.memory import check_compile_memory, compile_job_bytes
from neuron_buckets.kernels import block_kv_cpu
from neuron_buckets.model.checkpoint import build_model, model_config_of, save_weights, weights_fingerprint
from neuron_buckets.model.model_config import LlamaConfig
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
    attempts: int = 0  # times handed to a worker

    @property
    def name(self) -> str:
        return self.shape.name


@dataclass
class CompileReport:
    out: Path
    outcomes: list[Outcome] = field(default_factory=list)
    buckets: list[BucketRecord] = field(default_factory=list)
    draft: CompileReport | None = None  # the draft model's sub-artifact, when there is one

    @property
    def all_outcomes(self) -> list[Outcome]:
        """The target's pieces, then the draft model's."""
        return self.outcomes + (self.draft.all_outcomes if self.draft else [])

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.all_outcomes if o.status != "ok"]

    @property
    def compiled(self) -> list[Outcome]:
        return [o for o in self.all_outcomes if o.status == "ok" and not o.cached]


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


def fresh_layers(config: Config) -> bool:
    """Whether packed buckets get a fresh layer: as set, else where the attention's cost follows the
    block table's width (flex). The C++ attention on a CPU reads each segment's context
    alone, so a table of no columns gains nothing there (measured 0.99-1.04x the layer piece)."""
    if config.compile.fresh_layers is not None:
        return config.compile.fresh_layers
    return not block_kv_cpu.applies(config.compile.device, config.cache.dtype)


Notify = Callable[[str, Outcome], None]


class Compiler:
    def __init__(
        self, config: Config, out: Path, cache_dir: str | Path, fail_fast: bool = False, *,
        local_cache: Path | None = None, ray_address: str | None = None,
    ) -> None:
        """``cache_dir``: the graph cache, a local directory or a URL (then ``local_cache``, by
        default the user cache, holds the graphs pulled from it)."""
        self.config, self.out, self.fail_fast = config, Path(out), fail_fast
        self.old = check_owned(self.out)  # a directory that is not ours is refused before anything starts
        self.backend = get_backend(config.compile.backend)
        ok, why = self.backend.available()
        if not ok:
            raise BackendUnavailable(f"backend {self.backend.name!r} is not usable here: {why}")
        self.cache = GraphCache.open(cache_dir, local_cache)
        self.ray_address = ray_address
        if config.compile.executor == "ray":
            from neuron_buckets.compile.ray_executor import check_ray

            check_ray(ray_address)  # a missing extra or a wrong address fails before anything starts
        self.model_config = model_config_of(config.model.path)
        self.text_sources = text_sources(config.model.path)
        self.eos_token_ids = eos_token_ids(config.model.path, self.model_config.vocab_size)
        self.buckets = enumerate_grid(config)
        local_jobs = config.compile.jobs if config.compile.executor == "local" else 0
        check_compile_memory(config, self.model_config, local_jobs)
        decode_seq = 1 + config.buckets.speculation_length
        dynamic = self.backend.dynamic_shapes
        fresh = self.backend.fresh_prefill and fresh_layers(config)
        self.bucket_pieces = {b: bucket_pieces(b, dynamic, decode_seq, fresh) for b in self.buckets}
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
                enable_prefix_caching=config.cache.enable_prefix_caching,
            ),
        )
        self.toolchain = Toolchain(backend_source_digest(self.backend), backend_info.versions)
        self.keys = {
            s: graph_key(
                piece=s,
                model_config=self.manifest.model.config,
                cache=asdict(self.manifest.cache),
                backend=asdict(backend_info),
                sources=self.toolchain.sources,
            )
            for s in self.shapes
        }
        self.cache.check()  # an unusable store fails here, before anything is written
        self.draft = self._draft_compiler(cache_dir, local_cache)

    def _draft_compiler(self, cache_dir: str | Path, local_cache: Path | None) -> Compiler | None:
        """The compiler of the draft model's sub-artifact; a draft of another vocabulary is refused."""
        if (config := draft_config(self.config)) is None:
            return None
        draft = Compiler(config, self.out / DRAFT, cache_dir, self.fail_fast, local_cache=local_cache,
                         ray_address=self.ray_address)
        if (got := draft.model_config.vocab_size) != (want := self.model_config.vocab_size):
            raise ConfigError(
                f"speculative.draft_model: {config.model.path} has vocab_size {got}, the target "
                f"{want}; a draft model must share the target's vocabulary"
            )
        return draft

    @property
    def num_pieces(self) -> int:
        """Pieces this run builds or reuses, the draft's included."""
        return len(self.shapes) + (self.draft.num_pieces if self.draft else 0)

    def graph_file(self, key: str) -> Path:
        return self.out / GRAPHS / f"{key}.{self.backend.graph_ext}"

    def intact(self, old: Manifest | None) -> dict[str, PieceRecord]:
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

    def _write_libraries(self) -> None:
        """Build the C++ kernel the CPU graphs call and copy it into ``kernels/``, so that a
        serving host needs no compiler; a copy whose bytes already match is kept."""
        c = self.config
        if not (self.backend.cpu_kernels and block_kv_cpu.applies(c.compile.device, c.cache.dtype)):
            return
        built = block_kv_cpu.build()
        rel = f"{KERNELS}/{block_kv_cpu.LIBRARY}"
        path, digest = self.out / rel, sha256_file(built)
        if not (path.is_file() and sha256_file(path) == digest):
            atomic_write(path, lambda p: shutil.copyfile(built, p))
        self.manifest.libraries = {"block_kv_cpu": LibraryInfo(rel, digest)}

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
            compiled_for=self.manifest.graph_facts() if ok else None,
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

    def _entry(self, o: Outcome, path: Path) -> StoreEntry:
        """The store record of a graph this directory holds (to share one the remote store lacks)."""
        return StoreEntry(
            key=o.key, ext=self.backend.graph_ext, sha256=o.sha256, bytes=path.stat().st_size,
            compile_seconds=o.compile_seconds, piece=o.name, backend=self.backend.name,
            versions=self.toolchain.versions, toolchain=__version__, created=time.time(),
        )

    def _place(self, o: Outcome, hit: Hit) -> Outcome:
        """Link a verified cache graph into the directory; its sha256 is the one just checked."""
        place(hit.path, self.graph_file(o.key))
        o.sha256 = hit.entry.sha256
        return o

    def _finish(self, o: Outcome, err: str | None, notify: Notify) -> Outcome:
        if err is None:
            hit = self.cache.get(o.key, self.backend.graph_ext, self._damaged(o.shape, notify), listed=False)
            if hit:
                return self._place(o, hit)
            err = f"compiled, but the graph is not in the store {self.cache.shared.location}"
        log = self.out / "logs" / f"{o.name}.log"
        atomic_write(log, lambda p: p.write_text(err))
        last = err.strip().splitlines()[-1]
        o.status, o.error, o.log = "failed", last, log.relative_to(self.out).as_posix()
        return o

    def _damaged(self, shape: PieceShape, notify: Notify) -> Callable[[str], None]:
        return lambda why: notify("damaged", Outcome(shape, self.keys[shape], error=why))

    @contextmanager
    def executor(self, jobs: int | None = None) -> Iterator[PieceExecutor]:
        """The executor ``compile.executor`` names: ``jobs`` local processes (default
        ``compile.jobs``), or Ray tasks on the cluster at ``ray_address``."""
        c = self.config.compile
        if c.executor == "ray":
            from neuron_buckets.compile.ray_executor import RayExecutor

            task_bytes = compile_job_bytes(self.config, self.model_config)
            executor = RayExecutor(self.ray_address, c.task_cpus, task_bytes, not self.cache.shared.is_url)
        else:
            from neuron_buckets.compile.local_executor import LocalExecutor

            executor = LocalExecutor(jobs or c.jobs)
        try:
            yield executor
        finally:
            executor.close()

    def run(self, jobs: int | None = None, on_event: Notify | None = None) -> CompileReport:
        """Compile the pieces that are missing; ``on_event`` sees (event, outcome): "queued" when
        a piece goes to a worker, "done" when it is finished (compiled, reused or failed), "retry"
        when its worker died and it is queued again, "damaged" when a cache entry of it was
        discarded. Queued minus done (and retries) is what is compiling. The executor (Ray's
        connection) is only opened when something needs compiling."""
        notify = on_event or (lambda *_: None)
        ext = self.backend.graph_ext
        with owned_directory(self.out) as old:
            self.cache.local.remove_stale_temps()
            previous = self.intact(old)
            self._write_weights(old)
            self._write_libraries()
            self.manifest.text = write_text_files(self.text_sources, self.out, self.eos_token_ids)
            done: dict[PieceShape, Outcome] = {}
            todo: list[Outcome] = []
            for s in self.shapes:
                key = self.keys[s]
                if key in previous:
                    rec = previous[key]
                    secs, sha = rec.compile_seconds, rec.sha256
                    done[s] = o = Outcome(s, key, compile_seconds=secs, cached=True, sha256=sha)
                    self.cache.share(self.out / rec.file, self._entry(o, self.out / rec.file))
                elif hit := self.cache.get(key, ext, self._damaged(s, notify)):
                    secs = hit.entry.compile_seconds
                    done[s] = self._place(Outcome(s, key, compile_seconds=secs, cached=True), hit)
                else:
                    todo.append(Outcome(s, key))
            self._save(done)
            for o in done.values():
                notify("done", o)
            if todo:
                with self.executor(jobs) as executor:
                    self._compile_all(executor, todo, done, notify)
            ok = [self.graph_file(o.key) for o in done.values() if o.status == "ok"]
            keep = {f.relative_to(self.out).as_posix() for f in ok} | set(self.manifest.text.files)
            keep |= {lib.file for lib in self.manifest.libraries.values()}
            prune(self.out, old, keep)
            outcomes = [done[s] for s in self.shapes if s in done]
            report = CompileReport(self.out, outcomes, self.manifest.buckets)
            if self.draft is not None and not self._stopped(done):
                report.draft = self.draft.run(jobs, on_event)
            return report

    def _stopped(self, done: dict[PieceShape, Outcome]) -> bool:
        return self.fail_fast and any(o.status != "ok" for o in done.values())

    def _compile_all(
        self, executor: PieceExecutor, todo: list[Outcome], done: dict[PieceShape, Outcome], notify: Notify
    ) -> None:
        """Compile ``todo``, ``executor.slots`` at a time, so that ``--fail-fast`` starts nothing
        more. A worker that dies ends its pool (a local one is broken by it): the pieces then in
        flight are queued again and a fresh pool compiles the rest."""
        queue = deque(todo)
        while queue and not self._stopped(done):
            with executor.pool() as submit:
                self._drain(executor, submit, queue, done, notify)

    def _task(self, o: Outcome, executor: PieceExecutor) -> CompileTask:
        shared, local = self.cache.shared, self.cache.local
        mirror = local.location if executor.on_this_host and shared is not local else None
        store = shared.location
        return CompileTask(self.config, o.shape, o.key, store, mirror, self.toolchain, executor.threads)

    def _drain(
        self, executor: PieceExecutor, submit: Submit, queue: deque[Outcome], done: dict[PieceShape, Outcome],
        notify: Notify,
    ) -> None:
        """Feed the pool until the queue is empty, a piece fails under fail-fast, or a worker dies."""
        running: dict[Future, Outcome] = {}
        feeding = True
        while running or (feeding and queue):
            while feeding and queue and len(running) < executor.slots:
                o = queue.popleft()
                o.attempts += 1
                running[submit(self._task(o, executor))] = o
                notify("queued", o)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                o = running.pop(fut)
                try:
                    o.compile_seconds, err = fut.result()
                except Exception as e:  # the worker could not run it, or died
                    err = traceback.format_exc()
                    if executor.died(e):
                        feeding = False
                        if o.attempts <= self.config.compile.retries:
                            o.error = f"{type(e).__name__}: the worker died"
                            queue.appendleft(o)
                            notify("retry", o)
                            continue
                        err += f"{type(e).__name__}: the worker died on each of {o.attempts} attempts\n"
                o.error = None
                done[o.shape] = self._finish(o, err, notify)
                self._save(done)
                notify("done", o)
                feeding = feeding and not (err and self.fail_fast)


def place(src: Path, dest: Path) -> None:
    """Put a cached graph into an artifact directory atomically: hard link, else copy."""
    dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # never group-writable (owner_only.py)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
