"""Fitting a step's rows onto the compiled buckets: chunk long prompts, split big batches.

Pure bookkeeping over row lengths and contexts; the tensors are built by ``padding``.
"""

from __future__ import annotations

from collections.abc import Sequence

from neuron_buckets.core.bucket import Bucket, NoBucketFits
from neuron_buckets.core.padding import PrefillChunk

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


def _shape(group: Sequence[Indexed]) -> tuple[int, int, int]:
    """(rows, longest row, deepest context) that a bucket must hold for ``group``."""
    seq = max(len(c.token_ids) for _, c in group)
    ctx = max(c.start_pos + len(c.token_ids) for _, c in group)
    return len(group), seq, ctx


def _fitting(buckets: Sequence[Bucket], rows: int, seq: int, ctx: int) -> list[Bucket]:
    return [b for b in buckets if b.batch >= rows and b.seq >= seq and b.ctx >= ctx]


def smallest_fitting(buckets: Sequence[Bucket], rows: int, seq: int, ctx: int) -> Bucket:
    """The bucket with the least padded work that holds ``rows`` rows of ``seq`` tokens."""
    fits = _fitting(buckets, rows, seq, ctx)
    if not fits:
        largest = max(buckets, key=lambda b: (b.tokens, b.ctx))
        raise NoBucketFits(
            f"no bucket fits {rows} rows x {seq} tokens at context {ctx}: the largest is {largest.name}"
        )
    return min(fits, key=lambda b: (b.tokens, b.ctx, b.batch))


def group_rows(items: Sequence[Indexed], buckets: Sequence[Bucket]) -> list[tuple[list[Indexed], Bucket]]:
    """Split rows into calls, rows of similar context together, each call as wide as a bucket allows.

    A row joins the current call while some bucket still holds the call with it (wide buckets may
    be short: 4 rows x 32 tokens beside 1 row x 128), else it starts the next call.
    """
    ordered = sorted(items, key=lambda it: (it[1].start_pos + len(it[1].token_ids), len(it[1].token_ids)))
    calls: list[list[Indexed]] = []
    for item in ordered:
        if calls and _fitting(buckets, *_shape([*calls[-1], item])):
            calls[-1].append(item)
        else:
            calls.append([item])
    return [(group, smallest_fitting(buckets, *_shape(group))) for group in calls]
