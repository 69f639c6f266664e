"""Fitting a step's requests onto the compiled buckets, as pure bookkeeping over lengths.

The runtime and ``nb inspect`` call the same functions, so what the planner predicts is what the
runtime does. Prefill: chunks are laid end to end in one token bucket (up to ``max_rows`` of
them); only the first chunk of a step may continue a cached prompt, because a packed step reads
one block-table row of cached context. Decode: rows of similar context share a call, each call
as wide as the largest batch bucket, on the smallest context bucket that holds its deepest row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from neuron_buckets.core.bucket import Bucket, NoBucketFits, select_bucket


@dataclass(frozen=True)
class ChunkShape:
    """One request's chunk of a step: ``tokens`` new tokens after ``start`` cached ones."""

    tokens: int
    start: int = 0


def split_long(chunks: Sequence[ChunkShape], max_tokens: int) -> list[list[tuple[int, ChunkShape]]]:
    """Waves of pieces no longer than ``max_tokens``: wave k holds the k-th piece of every chunk.

    Running the waves in order lets each piece attend to the cache written by the earlier ones.
    """
    waves: list[list[tuple[int, ChunkShape]]] = []
    for i, c in enumerate(chunks):
        for k, lo in enumerate(range(0, c.tokens, max_tokens)):
            if k == len(waves):
                waves.append([])
            waves[k].append((i, ChunkShape(min(max_tokens, c.tokens - lo), c.start + lo)))
    return waves


def pack_prefill(
    chunks: Sequence[ChunkShape], token_buckets: Sequence[int], max_rows: int
) -> list[tuple[list[int], int]]:
    """Indices of ``chunks`` per call, in order, with the token bucket of each call.

    Every chunk must fit the largest bucket (``split_long`` first). A continuing chunk
    (``start > 0``) opens a call of its own that later fresh chunks may join.
    """
    calls: list[list[int]] = []
    used = 0
    largest = token_buckets[-1]
    for i, c in enumerate(chunks):
        if c.tokens > largest:
            raise NoBucketFits(f"a chunk of {c.tokens} tokens exceeds the largest prefill bucket {largest}")
        if not calls or c.start > 0 or used + c.tokens > largest or len(calls[-1]) == max_rows:
            calls.append([])
            used = 0
        calls[-1].append(i)
        used += c.tokens
    return [(call, select_bucket(token_buckets, sum(chunks[i].tokens for i in call))) for call in calls]


def group_decode(contexts: Sequence[int], buckets: Sequence[Bucket]) -> list[tuple[list[int], Bucket]]:
    """Indices of decode rows per call with its bucket. ``contexts[i]`` is the context row i
    reaches in this step (cached plus new tokens). Rows of similar context share a call."""
    width = max(b.batch for b in buckets)
    ctxs = sorted({b.ctx for b in buckets})
    order = sorted(range(len(contexts)), key=lambda i: contexts[i])
    out = []
    for lo in range(0, len(order), width):
        rows = order[lo : lo + width]
        ctx = max(contexts[i] for i in rows)
        if ctx > ctxs[-1]:
            raise NoBucketFits(f"a decode row reaching {ctx} tokens exceeds the largest context {ctxs[-1]}")
        fit_ctx = select_bucket(ctxs, ctx)
        at_ctx = sorted(b.batch for b in buckets if b.ctx == fit_ctx)
        batch = select_bucket(at_ctx, len(rows))
        out.append((rows, next(b for b in buckets if b.ctx == fit_ctx and b.batch == batch)))
    return out
