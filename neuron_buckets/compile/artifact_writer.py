"""Writes one artifact directory of a ``BuildPlan``: the weights, the kernel libraries, the
tokenizer files, every graph (linked from the graph cache), failure logs, and the manifest.

A file the last run wrote and whose bytes are still intact is kept, not rewritten; every write is
atomic (``utils/files.py``). The manifest is rewritten after every finished piece, so a kill at
any moment loses at most the pieces still compiling and the next run resumes with exactly those.
Pruning removes what the previous manifest listed and this one no longer does.
"""

from __future__ import annotations

import copy
import datetime as dt
import shutil
import time
from pathlib import Path

import torch

from neuron_buckets._version import __version__
from neuron_buckets.artifact.manifest import (
    KERNELS,
    WEIGHTS,
    BucketRecord,
    LibraryInfo,
    Manifest,
    PieceRecord,
    TextInfo,
    WeightsInfo,
    write_manifest,
)
from neuron_buckets.compile.build_plan import BuildPlan
from neuron_buckets.compile.graph_cache import Hit
from neuron_buckets.compile.outcome import Outcome
from neuron_buckets.compile.output_dir import LOGS, prune
from neuron_buckets.compile.store_entry import StoreEntry
from neuron_buckets.compile.text_files import write_text_files
from neuron_buckets.kernels.cpp_library import CppLibrary
from neuron_buckets.kernels.libraries import carried
from neuron_buckets.model.checkpoint import save_weights
from neuron_buckets.model.model_source import build_model, weights_fingerprint
from neuron_buckets.model.pieces import PieceShape
from neuron_buckets.utils.files import atomic_write, intact, link_or_copy, sha256_file


def kept_pieces(out: Path, previous: Manifest | None) -> dict[str, PieceRecord]:
    """Pieces of the last run whose graph file is still intact, by key."""
    records = previous.pieces.items() if previous else ()
    return {k: r for k, r in records if r.status == "ok" and intact(out / r.file, r.sha256)}


class ArtifactWriter:
    def __init__(self, plan: BuildPlan) -> None:
        self.plan, self.out = plan, plan.out
        self.manifest: Manifest = copy.deepcopy(plan.header)

    def write_files(self, previous: Manifest | None, sources: dict[str, bytes], eos: list[int]) -> None:
        """Everything but the graphs: the weights, the kernel libraries and the text files."""
        self._write_weights(previous)
        self._write_libraries()
        self.manifest.text = write_text_files(sources, self.out, eos)

    def _write_weights(self, previous: Manifest | None) -> None:
        """Write the one weights file, unless the last run wrote it from the same source and its
        bytes are intact (one hash: a damaged file is rewritten, not carried into the manifest)."""
        path, config = self.out / WEIGHTS, self.plan.config
        dtype = getattr(torch, config.cache.dtype)
        fingerprint = weights_fingerprint(config.model.path, dtype)
        kept = previous.weights if previous else None
        if kept and kept.source_fingerprint == fingerprint and intact(path, kept.sha256, kept.bytes):
            self.manifest.weights = kept
            return
        model = build_model(config.model.path, dtype)
        atomic_write(path, lambda p: save_weights(model, p))
        self.manifest.weights = WeightsInfo(WEIGHTS, sha256_file(path), path.stat().st_size, fingerprint)

    def _write_libraries(self) -> None:
        """Build the C++ kernels the CPU graphs call and copy them into ``kernels/``, so that a
        serving host needs no compiler; a copy whose bytes already match is kept."""
        libraries = {}
        for name, library in self._libraries().items():
            built = library.build()
            rel = f"{KERNELS}/{library.file_name}"
            path, digest = self.out / rel, sha256_file(built)
            if not intact(path, digest):
                atomic_write(path, lambda p, built=built: shutil.copyfile(built, p))
            libraries[name] = LibraryInfo(rel, digest)
        self.manifest.libraries = libraries

    def _libraries(self) -> dict[str, CppLibrary]:
        """The kernel libraries this artifact's graphs call, by manifest name (``kernels/libraries.py``
        chooses them), where the backend's CPU graphs call nb's kernels at all."""
        c, scheme = self.plan.config, self.plan.model_config.quantization
        if not self.plan.backend.cpu_kernels:
            return {}
        return carried(c.compile.device, c.cache.dtype, bool(scheme and scheme.activations == "int8_token"))

    def place(self, o: Outcome, hit: Hit) -> Outcome:
        """Link a verified cache graph into the directory; its sha256 is the one just checked."""
        link_or_copy(hit.path, self.plan.graph_file(o.key))
        o.sha256 = hit.entry.sha256
        return o

    def fail(self, o: Outcome, err: str) -> Outcome:
        """Record a failed piece: its last line in the manifest, the whole error in a log."""
        log = self.out / LOGS / f"{o.name}.log"
        atomic_write(log, lambda p: p.write_text(err))
        last = err.strip().splitlines()[-1]
        o.status, o.error, o.log = "failed", last, log.relative_to(self.out).as_posix()
        return o

    def entry(self, o: Outcome, path: Path) -> StoreEntry:
        """The store record of a graph this directory holds (to share one the remote store lacks)."""
        plan = self.plan
        return StoreEntry(
            key=o.key, ext=plan.backend.graph_ext, sha256=o.sha256, bytes=path.stat().st_size,
            compile_seconds=o.compile_seconds, piece=o.name, backend=plan.backend.name,
            versions=plan.toolchain.versions, toolchain=__version__, created=time.time(),
        )

    def _record(self, o: Outcome) -> PieceRecord:
        path = self.plan.graph_file(o.key)
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
        """Every bucket whose pieces are all finished (ok when all are), or that has a failed
        piece already, so that a run stopped by --fail-fast still records it."""
        records = []
        for b in self.plan.buckets:
            pieces = self.plan.bucket_pieces[b]
            finished = [done[s] for s in pieces.values() if s in done]
            failed = [o for o in finished if o.status != "ok"]
            if len(finished) < len(pieces) and not failed:
                continue
            error = f"{failed[0].name}: {failed[0].error}" if failed else None
            records.append(BucketRecord(
                b.kind, b.batch, b.seq, b.ctx, {role: self.plan.keys[s] for role, s in pieces.items()},
                "failed" if failed else "ok", error,
            ))
        return records

    def update(self, done: dict[PieceShape, Outcome]) -> None:
        """Bring the manifest in memory up to every piece and bucket finished so far."""
        self.manifest.created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.manifest.pieces = {o.key: self._record(o) for s in self.plan.shapes if (o := done.get(s))}
        self.manifest.buckets = self._bucket_records(done)

    def save(self, done: dict[PieceShape, Outcome]) -> None:
        """Rewrite the manifest with every piece and bucket finished so far (atomic)."""
        self.update(done)
        if self.manifest.buckets:
            write_manifest(self.out, self.manifest)

    def prune(self, previous: Manifest | None, done: dict[PieceShape, Outcome]) -> None:
        """Remove the files the previous manifest listed that this run no longer uses."""
        graphs = [self.plan.graph_file(o.key) for o in done.values() if o.status == "ok"]
        text = self.manifest.text or TextInfo([], {})
        keep = {f.relative_to(self.out).as_posix() for f in graphs} | set(text.files)
        keep |= {lib.file for lib in self.manifest.libraries.values()}
        prune(self.out, previous, keep)
