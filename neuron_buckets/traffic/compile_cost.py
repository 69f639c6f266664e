"""Compile time and graph bytes per bucket, read from an artifact directory's manifest.

Every extra bucket is another graph to compile (minutes each on Neuron) and to keep on disk, so a
plan trades padding against these. A bucket the manifest holds uses its measured numbers; any
other is estimated from a least-squares line in tokens per graph (batch x seq) fitted to the
manifest's successful buckets, so the estimate is only as good as the manifest it came from (and
blind to a graph's context: only measured buckets tell two contexts apart). Buckets are keyed by
their whole shape, ctx included: decode graphs that differ only in context are different graphs.
A bucket's cost is the sum of its three pieces (embed, layer, head), shared pieces counted in
each bucket that uses them: the upper bound of what adding or dropping it changes.

An artifact with a draft model (its ``draft/``) compiles the draft's grid beside every bucket set:
the same prefill buckets and decode batches and contexts, with rows of one token. ``graphs`` then
counts the draft's graphs of a set too, priced from the draft's own manifest, so ``nb plan``'s
compile budget covers both models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neuron_buckets.artifact.manifest import MANIFEST, BucketRecord, ManifestError, read_manifest
from neuron_buckets.config.draft import DRAFT
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.model_config import parse_hf_config
from neuron_buckets.runtime.memory import ranks_report


@dataclass(frozen=True)
class GraphCost:
    seconds: float
    bytes: int
    measured: bool  # False: estimated from the fitted line


@dataclass(frozen=True)
class CompileCost:
    """Measured costs by bucket (prefill ones with batch 1: a packed prefill graph is known by its
    tokens), a line in tokens for the rest, and the artifact's own decode contexts."""

    measured: dict[Bucket, tuple[float, int]]  # -> (seconds, bytes)
    seconds_line: tuple[float, float]  # (slope per token, intercept)
    bytes_line: tuple[float, float]
    contexts: tuple[int, ...]  # decode context buckets, ascending; the last is max_model_len
    decode_seq: int = 1  # tokens per request in the manifest's decode graphs
    draft: CompileCost | None = None  # the draft model's, compiled beside every set

    def estimate(self, bucket: Bucket) -> GraphCost:
        if (hit := self.measured.get(bucket)) is not None:
            return GraphCost(hit[0], hit[1], True)
        seconds = max(0.0, self.seconds_line[0] * bucket.tokens + self.seconds_line[1])
        size = max(0.0, self.bytes_line[0] * bucket.tokens + self.bytes_line[1])
        return GraphCost(seconds, int(round(size)), False)

    def shapes(
        self, prefill: Sequence[int], num_seqs: Sequence[int], contexts: Sequence[int] | None = None
    ) -> list[Bucket]:
        """The graphs of a bucket set, as the grid builds them: prefill graphs over the largest
        context, then every decode batch size at every context (by default the artifact's)."""
        contexts = tuple(contexts or self.contexts)
        return [Bucket("prefill", 1, s, contexts[-1]) for s in prefill] + [
            Bucket("decode", b, self.decode_seq, c) for c in contexts for b in num_seqs
        ]

    def graphs(
        self, prefill: Sequence[int], num_seqs: Sequence[int], contexts: Sequence[int] | None = None
    ) -> list[GraphCost]:
        """The set's graphs, then the draft model's graphs of the same set."""
        own = [self.estimate(b) for b in self.shapes(prefill, num_seqs, contexts)]
        return own + (self.draft.graphs(prefill, num_seqs, contexts) if self.draft else [])


@dataclass(frozen=True)
class ManifestBuckets:
    """The bucket sets an artifact directory was compiled with, and what they cost."""

    prefill: tuple[int, ...]  # token counts of the single-row prefill graphs
    num_seqs: tuple[int, ...]  # decode batch sizes
    cost: CompileCost


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares y = a x + b; a constant (the mean) when x has a single value."""
    if len(np.unique(x)) < 2:
        return 0.0, float(y.mean())
    a, b = np.polyfit(x, y, 1)
    return float(a), float(b)


def load_manifest_buckets(directory: str | Path) -> ManifestBuckets:
    """Bucket sets and compile costs of an artifact directory (its manifest, schema-checked)."""
    manifest = read_manifest(Path(directory))
    entries = manifest.buckets
    ok = [e for e in entries if e.status == "ok"]
    if not ok:
        raise ManifestError(f"{directory}: no bucket compiled successfully, nothing to fit costs to")

    def key(e: BucketRecord) -> Bucket:
        return Bucket(e.kind, 1 if e.kind == "prefill" else e.batch, e.seq, e.ctx)

    def cost(e: BucketRecord) -> tuple[float, int]:
        pieces = [manifest.pieces[k] for k in e.pieces.values()]
        return sum(p.compile_seconds for p in pieces), sum(p.bytes for p in pieces)

    measured = {key(e): cost(e) for e in ok}
    tokens = np.array([b.tokens for b in measured], dtype=np.float64)
    seconds = np.array([s for s, _ in measured.values()], dtype=np.float64)
    size = np.array([n for _, n in measured.values()], dtype=np.float64)
    contexts = sorted({e.ctx for e in entries if e.kind == "decode"} | {manifest.cache.max_model_len})
    decode_seq = 1 + manifest.decode.speculation_length
    sub = Path(directory) / DRAFT
    draft = load_manifest_buckets(sub).cost if (sub / MANIFEST).is_file() else None
    fitted = CompileCost(
        measured, _line(tokens, seconds), _line(tokens, size), tuple(contexts), decode_seq, draft
    )
    return ManifestBuckets(
        prefill=tuple(sorted({e.seq for e in entries if e.kind == "prefill"})),
        num_seqs=tuple(sorted({e.batch for e in entries if e.kind == "decode"})),
        cost=fitted,
    )


def manifest_ranks(directory: str | Path) -> dict:
    """An artifact's ``ranks_report``: its tensor-parallel degree, graphs and one rank's memory."""
    manifest = read_manifest(Path(directory))
    model = parse_hf_config(manifest.model.config, f"{directory} model.config")
    geo, ok = manifest.cache, [r.bucket for r in manifest.buckets if r.status == "ok"]
    graphs = sum(p.status == "ok" for p in manifest.pieces.values())
    return ranks_report(model, manifest.parallel.tensor_parallel_size, ok, geo.num_blocks, geo.block_size,
                        geo.dtype, graphs)
