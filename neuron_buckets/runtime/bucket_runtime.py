"""Serve steps from an artifact directory: pick the smallest bucket, pad, run, unpad.

``BucketRuntime.open`` validates the manifest, checks and loads the weights once, allocates the
one stacked KV cache every graph shares, and loads nothing else: each piece graph is loaded (and
its sha256 checked) on first use, so opening a directory of many buckets costs about nothing.
A step runs its bucket's embed piece, then its layer piece once per layer with that layer's
weights and cache slice (updated in place), then its head piece. It never imports the compiler:
artifacts flow one way, from ``nb compile`` to here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from neuron_buckets.artifact.manifest import BucketRecord, Manifest, ManifestError, read_manifest, sha256_file
from neuron_buckets.backends import GraphFn, get_backend
from neuron_buckets.core.bucket import Bucket, NoBucketFits
from neuron_buckets.core.padding import DecodeRow, PrefillChunk, StepInputs, pad_decode, pad_prefill
from neuron_buckets.model.llama import fuse_layer_weights, head_weight_names, layer_weight_keys, unfused_views
from neuron_buckets.runtime.artifact_check import DigestMismatch, check_servable, verified_copy
from neuron_buckets.runtime.packing import ChunkShape, group_decode, pack_prefill, split_long
from neuron_buckets.runtime.step_check import StepLimits, check_step
from neuron_buckets.utils.errors import UserError


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


class BucketRuntime:
    def __init__(self, directory: Path, manifest: Manifest, device: str) -> None:
        self.directory, self.manifest, self.device = Path(directory), manifest, device
        self.backend = get_backend(manifest.backend.name)
        self.config = check_servable(manifest, self.directory, device, self.backend.dynamic_shapes)
        self._check_versions()
        weights = self._load_weights()
        geo = manifest.cache
        self.block_size, self.num_blocks = geo.block_size, geo.num_blocks
        self.max_model_len = geo.max_model_len
        dtype = getattr(torch, geo.dtype)
        self.k_cache = torch.zeros(geo.shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(geo.shape, dtype=dtype, device=device)
        # Each call's inputs, bound once: per-layer weight tuples and cache slices (views).
        self.embed_weight = weights["model.embed_tokens.weight"]
        self.layer_weights = [self._fuse_layer(weights, i) for i in range(geo.num_layers)]
        self.head_weights = tuple(weights[n] for n in head_weight_names(self.config))
        self.layer_caches = list(zip(self.k_cache.unbind(0), self.v_cache.unbind(0), strict=True))
        self.weights = weights
        self.records = {
            Bucket(r.kind, r.batch, r.seq, r.ctx): r for r in manifest.buckets if r.status == "ok"
        }
        self.prefill_buckets = sorted(b for b in self.records if b.kind == "prefill")
        self.decode_buckets = sorted(b for b in self.records if b.kind == "decode")
        if not self.prefill_buckets or not self.decode_buckets:
            raise ArtifactError(f"{directory}: needs at least one working prefill and one decode bucket")
        self.decode_seq = self.decode_buckets[0].seq
        self.max_rows = max(b.batch for b in self.prefill_buckets)
        self.limits = StepLimits(self.block_size, self.num_blocks, self.max_model_len, self.config.vocab_size)
        self._graphs: dict[str, GraphFn] = {}
        self.stats = {b.name: BucketStats() for b in self.records}

    @classmethod
    def open(cls, path: str | Path, device: str | None = None, preload: bool = False) -> BucketRuntime:
        """Open an artifact directory; ``preload`` loads every graph now instead of on first use."""
        manifest = read_manifest(Path(path))
        runtime = cls(Path(path), manifest, device or manifest.backend.device)
        if preload:
            for record in runtime.records.values():
                for key in record.pieces.values():
                    runtime.graph(key)
        return runtime

    def _check_versions(self) -> None:
        recorded = self.manifest.backend.versions
        current = self.backend.load_versions()
        if diff := {k: (recorded.get(k), v) for k, v in current.items() if recorded.get(k) != v}:
            detail = ", ".join(f"{k}: built with {a}, running {b}" for k, (a, b) in diff.items())
            raise ManifestError(
                f"{self.directory}: graphs were compiled for other versions ({detail}); recompile"
            )

    def _load_weights(self) -> dict[str, Tensor]:
        info = self.manifest.weights
        path = self.directory / info.file
        if not path.is_file():
            raise ArtifactError(f"weights file {path} is missing")
        if sha256_file(path) != info.sha256:
            raise ArtifactError(f"{path} does not match the manifest's sha256: the weights were changed")
        return load_file(path, device=self.device)

    def _fuse_layer(self, weights: dict[str, Tensor], layer: int) -> tuple[Tensor, ...]:
        """Layer ``layer``'s piece inputs; its entries in ``weights`` become views of them, so the
        fused projections do not hold a second copy of the layer in memory."""
        prefix = f"model.layers.{layer}."
        own = {k: weights[prefix + k] for k in layer_weight_keys(self.config)}
        fused = fuse_layer_weights(self.config, own)
        weights.update({prefix + k: t for k, t in unfused_views(self.config, fused).items()})
        return fused

    def graph(self, key: str) -> GraphFn:
        """A piece's graph, loaded on first use after checking its file against the manifest."""
        if key in self._graphs:
            return self._graphs[key]
        rec = self.manifest.pieces[key]
        path = self.directory / rec.file
        if not path.is_file():
            raise ArtifactError(f"graph of piece {rec.name} is missing: {path}")
        try:
            with verified_copy(path, rec.sha256, f"graph of piece {rec.name}") as copy:
                fn = self.backend.load(copy, self.manifest.model.config, self.device)
        except DigestMismatch:
            raise ArtifactError(
                f"graph {path} of piece {rec.name} does not match its sha256 (corrupt or tampered)"
            ) from None
        self._graphs[key] = fn
        return fn

    @property
    def loaded(self) -> list[str]:
        """Keys of the piece graphs loaded so far."""
        return list(self._graphs)

    def reset_cache(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()

    def record(self, bucket: Bucket) -> BucketRecord:
        rec = self.records.get(bucket)
        if rec is None:
            raise NoBucketFits(f"bucket {bucket.name} is not in {self.directory}")
        return rec

    @torch.inference_mode()
    def run(self, bucket: Bucket, step: StepInputs) -> Tensor:
        """Run one padded step through the bucket's pieces; logits of the real samples only."""
        pieces = self.record(bucket).pieces
        embed, layer, head = (self.graph(pieces[role]) for role in ("embed", "layer", "head"))
        input_ids, positions, *state, sampling = (t.to(self.device) for t in step.args())
        h, cos, sin = embed(input_ids, positions, self.embed_weight)
        for weights, (k_cache, v_cache) in zip(self.layer_weights, self.layer_caches, strict=True):
            h = layer(h, cos, sin, *state, k_cache, v_cache, weights)
        logits = head(h, sampling, *self.head_weights)
        s = self.stats[bucket.name]
        s.calls += 1
        s.real_tokens += int((step.slot_mapping >= 0).sum())
        s.padded_tokens += bucket.tokens
        return logits[: step.num_samples]

    def prefill(self, chunks: Sequence[PrefillChunk]) -> Tensor:
        """Prefill requests; (R, vocab) logits of each request's last token.

        Chunks are packed end to end into as few token-bucket calls as fit; prompts longer than
        the largest bucket run as successive pieces, each attending to the cache the earlier ones
        wrote. Everything is checked before the first cache write.
        """
        check_step(chunks, self.limits)
        token_buckets = [b.seq for b in self.prefill_buckets]
        shapes = [ChunkShape(len(c.token_ids), c.start_pos) for c in chunks]
        by_seq = {b.seq: b for b in self.prefill_buckets}
        last: dict[int, Tensor] = {}
        for wave in split_long(shapes, token_buckets[-1]):
            pieces = [
                PrefillChunk(chunks[i].token_ids[s.start - chunks[i].start_pos :][: s.tokens], s.start,
                             chunks[i].block_ids)
                for i, s in wave
            ]
            for call, seq in pack_prefill([s for _, s in wave], token_buckets, self.max_rows):
                bucket = by_seq[seq]
                logits = self.run(bucket, pad_prefill([pieces[j] for j in call], bucket, self.block_size))
                for j, row in zip(call, logits, strict=True):
                    last[wave[j][0]] = row
        return torch.stack([last[i] for i in range(len(chunks))])

    def decode(self, rows: Sequence[DecodeRow]) -> Tensor:
        """One decode step for every row (split over several calls if needed); (R, seq, vocab)."""
        check_step(rows, self.limits, max_tokens=self.decode_seq)
        out: list[Tensor] = [torch.empty(0)] * len(rows)
        contexts = [r.start_pos + len(r.token_ids) for r in rows]
        for group, bucket in group_decode(contexts, self.decode_buckets):
            logits = self.run(bucket, pad_decode([rows[i] for i in group], bucket, self.block_size))
            for k, i in enumerate(group):
                out[i] = logits[k * bucket.seq : (k + 1) * bucket.seq]
        return torch.stack(out)


__all__ = ["ArtifactError", "BucketRuntime", "BucketStats", "NoBucketFits"]
