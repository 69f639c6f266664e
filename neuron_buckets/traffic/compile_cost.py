"""Compile time and graph bytes per bucket, read from an artifact directory's manifest.

Every extra bucket is another graph to compile (minutes each on Neuron) and to keep on disk, so a
plan trades padding against these. A bucket the manifest holds uses its measured numbers; any
other is estimated from a least-squares line in tokens per graph (batch x seq) fitted to the
manifest's successful buckets, so the estimate is only as good as the manifest it came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neuron_buckets.artifact.manifest import ManifestError, read_manifest


@dataclass(frozen=True)
class GraphCost:
    seconds: float
    bytes: int
    measured: bool  # False: estimated from the fitted line


@dataclass(frozen=True)
class CompileCost:
    measured: dict[tuple[str, int, int], tuple[float, int]]  # (kind, batch, seq) -> (s, bytes)
    seconds_line: tuple[float, float]  # (slope per token, intercept)
    bytes_line: tuple[float, float]
    decode_seq: int = 1  # tokens per request in the manifest's decode graphs

    def estimate(self, kind: str, batch: int, seq: int) -> GraphCost:
        if (hit := self.measured.get((kind, batch, seq))) is not None:
            return GraphCost(hit[0], hit[1], True)
        tokens = batch * seq
        seconds = max(0.0, self.seconds_line[0] * tokens + self.seconds_line[1])
        size = max(0.0, self.bytes_line[0] * tokens + self.bytes_line[1])
        return GraphCost(seconds, int(round(size)), False)

    def shapes(self, prefill: Sequence[int], num_seqs: Sequence[int]) -> list[tuple[str, int, int]]:
        """(kind, batch, seq) of a bucket set: single-row prefill graphs, then decode graphs."""
        return [("prefill", 1, s) for s in prefill] + [("decode", b, self.decode_seq) for b in num_seqs]

    def graphs(self, prefill: Sequence[int], num_seqs: Sequence[int]) -> list[GraphCost]:
        return [self.estimate(*shape) for shape in self.shapes(prefill, num_seqs)]


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
    entries = manifest["buckets"]
    ok = [e for e in entries if e["status"] == "ok"]
    if not ok:
        raise ManifestError(f"{directory}: no bucket compiled successfully, nothing to fit costs to")
    measured = {(e["kind"], e["batch"], e["seq"]): (e["compile_seconds"], e["bytes"]) for e in ok}
    tokens = np.array([e["batch"] * e["seq"] for e in ok], dtype=np.float64)
    seconds = np.array([e["compile_seconds"] for e in ok], dtype=np.float64)
    size = np.array([e["bytes"] for e in ok], dtype=np.float64)
    decode_seq = 1 + manifest["decode"]["speculation_length"]
    cost = CompileCost(measured, _line(tokens, seconds), _line(tokens, size), decode_seq)
    prefill = {e["seq"] for e in entries if e["kind"] == "prefill" and e["batch"] == 1}
    return ManifestBuckets(
        prefill=tuple(sorted(prefill)),
        num_seqs=tuple(sorted({e["batch"] for e in entries if e["kind"] == "decode"})),
        cost=cost,
    )
