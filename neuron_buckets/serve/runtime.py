"""Serve steps from an artifact directory: pick the smallest bucket, pad, run, unpad.

``BucketRuntime.open`` validates the manifest, checks and loads the weights once, allocates the
one KV cache every graph shares, and loads nothing else: each bucket graph is loaded (and its
sha256 checked) on first use, so opening a directory of many buckets costs about one graph.
It never imports the compiler: artifacts flow one way, from ``nb compile`` to here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from neuron_buckets.artifact.manifest import ManifestError, read_manifest, sha256_file
from neuron_buckets.backends import GraphFn, get_backend
from neuron_buckets.core.bucket import Bucket, NoBucketFits, select_bucket
from neuron_buckets.core.errors import UserError
from neuron_buckets.core.padding import DecodeRow, PrefillChunk, StepInputs, pad_decode, pad_prefill
from neuron_buckets.serve.artifact_check import check_servable
from neuron_buckets.serve.request_check import StepLimits, check_step
from neuron_buckets.serve.row_packer import group_rows, split_long_chunks


class ArtifactError(UserError, RuntimeError):
    """A graph or weights file that is missing or does not match its manifest entry."""


@dataclass
class BucketStats:
    """What vLLM-neuron exports as ``prefill_s{N}`` / ``decode_b{N}``: use and waste per bucket.

    As in ``nb inspect``: ``padded_tokens`` is every position computed (real and pad), so the
    waste is ``(padded - real) / real``.
    """

    calls: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0

    @property
    def padding_ratio(self) -> float:
        return (self.padded_tokens - self.real_tokens) / max(self.real_tokens, 1)


def stats_label(bucket: Bucket, max_model_len: int) -> str:
    if bucket.kind == "prefill":
        rows = "" if bucket.batch == 1 else f"_b{bucket.batch}"
        return f"prefill{rows}_s{bucket.seq}"
    ctx = "" if bucket.ctx == max_model_len else f"_c{bucket.ctx}"
    return f"decode_b{bucket.batch}{ctx}"


class BucketRuntime:
    def __init__(self, directory: Path, manifest: dict[str, Any], device: str) -> None:
        self.directory, self.manifest, self.device = Path(directory), manifest, device
        self.backend = get_backend(manifest["backend"]["name"])
        model = check_servable(manifest, self.directory, device)
        self._check_versions()
        self.weights = self._load_weights()
        geo = manifest["cache"]
        self.block_size, self.num_blocks = geo["block_size"], geo["num_blocks"]
        self.max_model_len = geo["max_model_len"]
        shape = (
            geo["num_layers"],
            geo["num_blocks"],
            geo["block_size"],
            geo["num_kv_heads"],
            geo["head_dim"],
        )
        dtype = getattr(torch, geo["dtype"])
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.records = {
            Bucket(r["kind"], r["batch"], r["seq"], r["ctx"]): r
            for r in manifest["buckets"]
            if r["status"] == "ok"
        }
        self.prefill_buckets = sorted(b for b in self.records if b.kind == "prefill")
        self.decode_buckets = sorted(b for b in self.records if b.kind == "decode")
        if not self.prefill_buckets or not self.decode_buckets:
            raise ArtifactError(f"{directory}: needs at least one working prefill and one decode bucket")
        self.decode_seq = self.decode_buckets[0].seq
        self.limits = StepLimits(self.block_size, self.num_blocks, self.max_model_len, model.vocab_size)
        self._graphs: dict[Bucket, GraphFn] = {}
        self.stats = {stats_label(b, self.max_model_len): BucketStats() for b in self.records}

    @classmethod
    def open(cls, path: str | Path, device: str | None = None, preload: bool = False) -> BucketRuntime:
        """Open an artifact directory; ``preload`` loads every graph now instead of on first use."""
        manifest = read_manifest(Path(path))
        runtime = cls(Path(path), manifest, device or manifest["backend"]["device"])
        if preload:
            for bucket in runtime.records:
                runtime.graph(bucket)
        return runtime

    def _check_versions(self) -> None:
        recorded = self.manifest["backend"]["versions"]
        current = self.backend.load_versions()
        if diff := {k: (recorded.get(k), v) for k, v in current.items() if recorded.get(k) != v}:
            detail = ", ".join(f"{k}: built with {a}, running {b}" for k, (a, b) in diff.items())
            raise ManifestError(
                f"{self.directory}: graphs were compiled for other versions ({detail}); recompile"
            )

    def _load_weights(self) -> dict[str, Tensor]:
        info = self.manifest["weights"]
        path = self.directory / info["file"]
        if not path.is_file():
            raise ArtifactError(f"weights file {path} is missing")
        if sha256_file(path) != info["sha256"]:
            raise ArtifactError(f"{path} does not match the manifest's sha256: the weights were changed")
        return load_file(path, device=self.device)

    def graph(self, bucket: Bucket) -> GraphFn:
        """The bucket's graph, loaded on first use after checking its file against the manifest."""
        if bucket in self._graphs:
            return self._graphs[bucket]
        rec = self.records.get(bucket)
        if rec is None:
            raise NoBucketFits(f"bucket {bucket.name} is not in {self.directory}")
        path = self.directory / rec["file"]
        if not path.is_file():
            raise ArtifactError(f"graph of bucket {bucket.name} is missing: {path}")
        if sha256_file(path) != rec["sha256"]:
            raise ArtifactError(
                f"graph {path} of bucket {bucket.name} does not match its sha256 (corrupt or tampered)"
            )
        fn = self.backend.load(path, self.weights, self.manifest["model"]["config"], self.device)
        self._graphs[bucket] = fn
        return fn

    @property
    def loaded(self) -> list[Bucket]:
        return list(self._graphs)

    def reset_cache(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()

    def run(self, bucket: Bucket, step: StepInputs) -> Tensor:
        """Run one padded step; logits of the real samples only, (num_samples, vocab)."""
        args = [t.to(self.device) for t in step.args()]
        logits = self.graph(bucket)(*args, self.k_cache, self.v_cache)
        if isinstance(logits, (list, tuple)):
            logits = logits[0]
        real = int((step.slot_mapping >= 0).sum())
        s = self.stats[stats_label(bucket, self.max_model_len)]
        s.calls, s.real_tokens, s.padded_tokens = (
            s.calls + 1,
            s.real_tokens + real,
            s.padded_tokens + bucket.tokens,
        )
        return logits[: step.num_samples]

    def prefill(self, chunks: Sequence[PrefillChunk]) -> Tensor:
        """Prefill requests; (R, vocab) logits of each request's last token.

        Prompts longer than the largest prefill bucket run as successive chunks, each attending to
        the cache the earlier ones wrote. Everything is checked before the first cache write.
        """
        check_step(chunks, self.limits)
        max_seq = max(b.seq for b in self.prefill_buckets)
        last: dict[int, Tensor] = {}
        for wave in split_long_chunks(chunks, max_seq):
            for group, bucket in group_rows(wave, self.prefill_buckets):
                logits = self.run(bucket, pad_prefill([c for _, c in group], bucket, self.block_size))
                for (i, _), row in zip(group, logits, strict=True):
                    last[i] = row
        return torch.stack([last[i] for i in range(len(chunks))])

    def decode(self, rows: Sequence[DecodeRow]) -> Tensor:
        """One decode step for every row (split over several calls if needed); (R, seq, vocab)."""
        check_step(rows, self.limits, max_tokens=self.decode_seq)
        out: list[Tensor] = [torch.empty(0)] * len(rows)
        for group, bucket in group_rows(list(enumerate(rows)), self.decode_buckets):
            logits = self.run(bucket, pad_decode([r for _, r in group], bucket, self.block_size))
            for k, (i, _) in enumerate(group):
                out[i] = logits[k * bucket.seq : (k + 1) * bucket.seq]
        return torch.stack(out)


__all__ = ["ArtifactError", "BucketRuntime", "BucketStats", "NoBucketFits", "select_bucket"]
