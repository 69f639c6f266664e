"""The bucket grid a config asks for: config -> grid is the first step of ``nb compile``."""

from __future__ import annotations

from neuron_buckets.config.config import Config
from neuron_buckets.core.bucket import Bucket


def enumerate_grid(config: Config) -> list[Bucket]:
    """Every bucket the config asks for: prefill token counts, then decode batch sizes x contexts.

    A prefill bucket packs up to ``max_num_seqs`` requests (never more than it has tokens). An
    embedding artifact (``model.task = "embed"``) only prefills, so it has no decode buckets.
    """
    b, cache = config.buckets, config.cache
    prefill = [
        Bucket("prefill", min(b.max_num_seqs, seq), seq, cache.max_model_len)
        for seq in b.num_batched_tokens_buckets
    ]
    if config.model.embeds:
        return prefill
    contexts = b.decode_context_length_buckets
    decode = [
        Bucket("decode", rows, 1 + b.speculation_length, ctx)
        for ctx in contexts
        for rows in b.num_seqs_buckets
    ]
    return prefill + decode
