"""The runtime's check of a whole step, before the first graph call of it writes the cache.

A step may take several graph calls (chunks, split batches), and every call writes K/V; a value
that only a later call, or the graph itself, would reject leaves the cache half-written. Compiled
graphs do not bounds-check (inductor reads out of range or fails mid-graph), so this check is
the runtime's, not the graph's, and every backend refuses the same steps. It covers every id the
graphs will see: token ids against the vocabulary, positions, and every entry of each block-table
row (the spare entries beyond the blocks a request needs too). Only integers pass: a float
would be truncated and a bool read as 0 or 1.

With prefix caching several segments read one block: the full blocks below a segment's context
(``context_len // block_size`` of them) are read-only, and those may be shared. A block a segment
writes (from its first new token's block on) must be its own: no other segment of the step may
write it or read it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from neuron_buckets.core.block_table import NULL_BLOCK_ID
from neuron_buckets.core.bucket import NoBucketFits
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.utils.ascii_int import is_int

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class StepLimits:
    """What the artifact can hold: the cache geometry and the vocabulary."""

    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int


def _int_list(values: Sequence[int] | Tensor, what: str) -> list[int]:
    """``values`` as plain ints, or a ValueError: floats, bools and other types are not ids."""
    if isinstance(values, Tensor):
        if values.dim() != 1 or values.dtype not in INT_DTYPES:
            raise ValueError(f"{what} must be a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{what} must be a sequence of integers, got {type(values).__name__}")
    if all(type(v) is int for v in values):  # the common case, without the ABC check per value
        return list(values)
    if bad := [v for v in values if not is_int(v)]:
        raise ValueError(f"{what} must be integers, got {bad[:5]}")
    return [int(v) for v in values]


def check_token_ids(values: Sequence[int] | Tensor, vocab_size: int, what: str) -> list[int]:
    """The ids as ints, each in [0, vocab_size), or a ValueError naming ``what`` and the bad ids."""
    ids = _int_list(values, f"{what} token ids")
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise ValueError(f"{what} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return ids


def check_step(plan: Sequence[Segment], limits: StepLimits) -> None:
    """Refuse a plan that cannot run whole."""
    if not plan:
        raise ValueError("a step needs at least one request")
    writes: list[int] = []
    reads: dict[int, int] = {}  # read-only block -> the first segment reading it
    for i, row in enumerate(plan):
        n = len(check_token_ids(row.token_ids, limits.vocab_size, f"request {i}"))
        if not n:
            raise ValueError(f"request {i} has no tokens")
        if not is_int(row.context_len) or row.context_len < 0:
            raise ValueError(
                f"request {i}: context_len must be a non-negative integer, got {row.context_len!r}"
            )
        if not is_int(row.num_samples) or not 0 <= row.num_samples <= n:
            raise ValueError(
                f"request {i}: num_samples must be an integer in [0, {n}], got {row.num_samples!r}"
            )
        end = row.context_len + n
        if end > limits.max_model_len:
            raise NoBucketFits(
                f"request {i} reaching {end} tokens exceeds max_model_len {limits.max_model_len}"
            )
        blocks = _int_list(row.block_ids, f"request {i} block_ids")
        need = -(-end // limits.block_size)
        if len(blocks) < need:
            raise ValueError(
                f"request {i} of {end} tokens has blocks for only {len(blocks) * limits.block_size}"
            )
        mine, spare = blocks[:need], blocks[need:]
        if any(not NULL_BLOCK_ID < b < limits.num_blocks for b in mine) or any(
            not NULL_BLOCK_ID <= b < limits.num_blocks for b in spare
        ):
            raise ValueError(
                f"block ids must lie in [1, {limits.num_blocks}), got {blocks} (request {i}; "
                f"entries after the {need} it needs may also be {NULL_BLOCK_ID}, unused)"
            )
        if len(set(mine)) != len(mine):
            raise ValueError(f"request {i} lists a block twice in its block table {mine}")
        frozen = row.context_len // limits.block_size
        writes.extend(mine[frozen:])
        for b in mine[:frozen]:
            reads.setdefault(b, i)
    if twice := [b for b, count in Counter(writes).items() if count > 1]:
        raise ValueError(f"block {min(twice)} is written twice in one step; a block it writes has one owner")
    if shared := sorted(set(writes) & reads.keys()):
        raise ValueError(
            f"block {shared[0]} is written in a step in which request {reads[shared[0]]} reads it; "
            "only full, read-only blocks may be shared"
        )
