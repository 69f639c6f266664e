"""``[buckets]``: the step shapes that get a compiled graph (vLLM-neuron's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketConfig:
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 128
    num_seqs_buckets: tuple[int, ...] = (1, 2, 4)
    num_batched_tokens_buckets: tuple[int, ...] = (32, 64, 128)
    speculation_length: int = 0
    decode_context_length_buckets: tuple[int, ...] = (256,)
