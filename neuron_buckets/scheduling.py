"""Fitting a step's rows onto the compiled buckets: chunk long prompts, split big batches.

Pure bookkeeping over row lengths and contexts; the tensors are built by ``padding``.
"""

from __future__ import annotations

from collections.abc import Sequence

from neuron_buckets.grid import Bucket, NoBucketFits
from neuron_buckets.padding import PrefillChunk

Indexed = tuple[int, PrefillChunk]


def split_long_chunks(chunks: Sequence[PrefillChunk], max_seq: int) -> list[list[Indexed]]:
    """Waves of pieces no longer than ``max_seq``: wave k holds the k-th piece of every request.

    Running the waves in order lets each piece attend to the cache written by the earlier ones.
    """
    waves: list[list[Indexed]] = []
    for i, c in enumerate(chunks):
        for k, lo in enumerate(range(0, len(c.token_ids), max_seq)):
            if k == len(waves):
                waves.append([])
            piece = PrefillChunk(c.token_ids[lo : lo + max_seq], c.start_pos + lo, c.block_ids)
            waves[k].append((i, piece))
    return waves


def smallest_fitting(buckets: Sequence[Bucket], rows: int, seq: int, ctx: int) -> Bucket:
    """The bucket with the least padded work that holds ``rows`` rows of ``seq`` tokens."""
    fits = [b for b in buckets if b.batch >= rows and b.seq >= seq and b.ctx >= ctx]
    if not fits:
        largest = max(buckets, key=lambda b: (b.tokens, b.ctx))
        raise NoBucketFits(
            f"no bucket fits {rows} rows x {seq} tokens at context {ctx}: the largest is {largest.name}"
        )
    return min(fits, key=lambda b: (b.tokens, b.ctx, b.batch))


def group_rows(items: Sequence[Indexed], buckets: Sequence[Bucket]) -> list[tuple[list[Indexed], Bucket]]:
    """Split rows into calls of at most the largest batch, rows of similar context together."""
    max_rows = max(b.batch for b in buckets)
    ordered = sorted(items, key=lambda it: it[1].start_pos + len(it[1].token_ids))
    calls = []
    for lo in range(0, len(ordered), max_rows):
        group = ordered[lo : lo + max_rows]
        seq = max(len(c.token_ids) for _, c in group)
        ctx = max(c.start_pos + len(c.token_ids) for _, c in group)
        calls.append((group, smallest_fitting(buckets, len(group), seq, ctx)))
    return calls
