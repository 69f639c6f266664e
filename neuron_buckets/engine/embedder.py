"""Embeddings from an embedding artifact: inputs packed into prefill steps, their final-norm
hidden states pooled (``pooler.py``).

An embedding needs no decoding and keeps nothing: each batch of inputs is prefilled once into
blocks of its own, pooled, and its blocks are free for the next batch. So there is no scheduler
and no block pool, only a run of block ids handed out in order: the inputs go into one step plan
while their blocks fit the cache (more are in the next plan), and the runtime packs each plan
into as few bucket calls as hold it, as it does any prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from neuron_buckets.artifact.manifest import Manifest
from neuron_buckets.core.block_table import NULL_BLOCK_ID
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.engine.pooler import Pooler
from neuron_buckets.engine.request_check import RequestError, checked_ids
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.runtime.bucket_runtime import ArtifactError, BucketRuntime


class Embedder:
    def __init__(self, runtime: BucketRuntime, pooler: Pooler | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """``pooler``: the artifact's own pooling unless given."""
        info = runtime.manifest.embedding
        if info is None:
            raise ArtifactError(f"{runtime.directory} was compiled for generation, not embeddings: "
                                'compile it with model.task = "embed"')
        if runtime.owner is not None:
            raise ValueError("the runtime's KV cache already has an owner; open the artifact again")
        runtime.claim(self)
        self.runtime, self.tokenizer = runtime, tokenizer
        self.pooler = pooler or Pooler(info.pooling, info.normalize)

    @classmethod
    def open(cls, directory: str | Path, device: str | None = None, pooling: str | None = None,
             preload: bool = False, manifest: Manifest | None = None) -> Embedder:
        """An embedder over an artifact directory (its ``manifest``, if read already), its
        tokenizer (if it has one), and ``pooling`` in place of the artifact's when given."""
        runtime = BucketRuntime.open(directory, device, preload=preload, manifest=manifest)
        info = runtime.manifest.embedding
        pooler = Pooler(pooling, info.normalize) if pooling is not None and info is not None else None
        return cls(runtime, pooler, Tokenizer.open(directory, runtime.manifest))

    @property
    def max_model_len(self) -> int:
        return self.runtime.max_model_len

    @property
    def hidden_size(self) -> int:
        return self.runtime.config.hidden_size

    def check_input(self, token_ids: Sequence[int] | Tensor, what: str = "input") -> list[int]:
        """The input's ids as ints, or a RequestError: empty, outside the vocabulary, or longer
        than ``max_model_len``."""
        limits = self.runtime.limits
        ids = checked_ids(token_ids, limits, what)
        if len(ids) > limits.max_model_len:
            raise RequestError(f"{what} has {len(ids)} tokens, over max_model_len {limits.max_model_len}")
        return ids

    def embed(self, inputs: Sequence[Sequence[int]]) -> Tensor:
        """(N, hidden) float32 embeddings of the inputs, in order."""
        ids = [self.check_input(t, f"input {i}") for i, t in enumerate(inputs)]
        hidden: list[Tensor] = []
        for plan in self._plans(ids):
            hidden += self.runtime.hidden_states(plan)
        return self.pooler(hidden)

    def _plans(self, inputs: list[list[int]]) -> list[tuple[Segment, ...]]:
        """The inputs in order, as step plans whose blocks fit the cache: block ids 1, 2, ... from
        each plan's start (one plan ends before the next writes)."""
        size, usable = self.runtime.block_size, self.runtime.num_blocks - 1
        plans: list[list[Segment]] = [[]]
        first = NULL_BLOCK_ID + 1
        for ids in inputs:
            need = -(-len(ids) // size)  # max_model_len fits the cache: the config checks it
            if first + need - 1 > usable and plans[-1]:
                plans.append([])
                first = NULL_BLOCK_ID + 1
            plans[-1].append(Segment(len(plans[-1]), ids, 0, list(range(first, first + need)), 0))
            first += need
        return [tuple(p) for p in plans if p]
