"""Padding a step to a bucket's fixed shape without ever touching real KV data.

A step is ``batch`` block-table rows of ``seq`` token positions each, flattened row-major. Pad
tokens get position 0 and slot -1 (they write nothing); dummy rows copy row 0's block table
(they allocate nothing) and have cache length 0; only real rows are sampled. Blocks are allocated
by the caller for actual tokens only, so padding never needs a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
from torch import Tensor

from neuron_buckets.core.block_table import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    compute_slot_mapping,
    remap_null_block_to_sentinel,
)
from neuron_buckets.core.bucket import Bucket, NoBucketFits


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens of one request written at positions ``start_pos``, ``start_pos + 1``, ..."""

    token_ids: Sequence[int] | Tensor
    start_pos: int
    block_ids: Sequence[int]


DecodeRow = PrefillChunk  # one request's 1 + speculation_length tokens, same fields


@dataclass(frozen=True)
class StepInputs:
    """Fixed-shape graph inputs for one bucket; all tensors int64."""

    input_ids: Tensor  # (T,) with T = batch * seq
    positions: Tensor  # (T,)
    slot_mapping: Tensor  # (T,)
    block_table: Tensor  # (batch, ctx // block_size), -1 for unused entries
    cache_lens: Tensor  # (batch,) tokens already cached before this step
    sampling_positions: Tensor  # (N,) flat token indices whose logits the graph returns
    num_rows: int  # real rows at the front
    num_samples: int  # real entries at the front of sampling_positions

    def args(self) -> tuple[Tensor, ...]:
        """The graph's positional inputs, before the caches."""
        return (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.block_table,
            self.cache_lens,
            self.sampling_positions,
        )

    @property
    def real_sampling_positions(self) -> Tensor:
        return self.sampling_positions[: self.num_samples]


def pad_prefill(chunks: Sequence[PrefillChunk], bucket: Bucket, block_size: int) -> StepInputs:
    """One row per request chunk; the logits of each row's last real token are sampled."""
    return _pad(chunks, bucket, block_size, sample_every_token=False)


def pad_decode(rows: Sequence[DecodeRow], bucket: Bucket, block_size: int) -> StepInputs:
    """One row per request of up to ``1 + speculation_length`` tokens; every real token is sampled.

    The first ``num_rows * seq`` samples are the real rows, row by row; a short row's pad entries
    point at its token 0, so a caller slicing per row never reads a pad token's logits.
    """
    return _pad(rows, bucket, block_size, sample_every_token=True)


def _ragged(lists: Sequence[Sequence[int] | Tensor]) -> tuple[Tensor, Tensor]:
    """Concatenate per-request id lists into one tensor (one conversion, not one per request)."""
    lens = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    if all(isinstance(x, Tensor) for x in lists):
        return torch.cat([x.reshape(-1) for x in lists]).to(torch.int64), lens
    plain = [x.tolist() if isinstance(x, Tensor) else x for x in lists]
    flat = plain[0] if len(plain) == 1 else list(chain.from_iterable(plain))
    return torch.as_tensor(flat, dtype=torch.int64), lens


def _pad(
    rows: Sequence[PrefillChunk], bucket: Bucket, block_size: int, sample_every_token: bool
) -> StepInputs:
    batch, seq = bucket.batch, bucket.seq
    max_blocks = bucket.ctx // block_size
    if not rows:
        raise ValueError("a step needs at least one request")
    if len(rows) > batch:
        raise NoBucketFits(f"{len(rows)} requests do not fit bucket {bucket.name} (batch {batch})")
    flat_ids, lens = _ragged([r.token_ids for r in rows])
    if int(lens.min()) == 0:
        raise ValueError("every request in a step needs at least one token")
    if int(lens.max()) > seq:
        raise NoBucketFits(
            f"a request of {int(lens.max())} tokens does not fit bucket {bucket.name} (seq {seq})"
        )
    starts = torch.tensor([r.start_pos for r in rows], dtype=torch.int64)
    if int(starts.min()) < 0:
        raise ValueError(f"start positions must be >= 0, got {starts.tolist()}")
    if int((starts + lens).max()) > bucket.ctx:
        raise NoBucketFits(
            f"context {int((starts + lens).max())} exceeds bucket {bucket.name} (ctx {bucket.ctx})"
        )

    table = torch.full((batch, max_blocks), NULL_BLOCK_ID, dtype=torch.int64)
    flat_blocks, counts = _ragged([r.block_ids[:max_blocks] for r in rows])
    row_of = torch.repeat_interleave(torch.arange(len(rows)), counts)
    first = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    table[row_of, torch.arange(flat_blocks.numel()) - first] = flat_blocks
    table[len(rows) :] = table[0]
    # Every block under a row's context must be allocated: attention reads [0, start) from the
    # cache, and a hole there would silently read the null block as if it held real K/V.
    needed = -(-(starts + lens) // block_size)
    holes = (torch.arange(max_blocks) < needed[:, None]) & (table[: len(rows)] <= NULL_BLOCK_ID)
    if bool(holes.any()):
        r, col = (int(i) for i in holes.nonzero()[0])
        raise ValueError(
            f"request {r} covers positions [0, {int(starts[r] + lens[r])}) but its logical block {col} "
            f"is unallocated (entry {int(table[r, col])}); allocate blocks before padding"
        )

    offsets = torch.arange(seq, dtype=torch.int64)
    real = torch.zeros(batch, seq, dtype=torch.bool)
    real[: len(rows)] = offsets < lens[:, None]
    positions = torch.zeros(batch, seq, dtype=torch.int64)
    positions[: len(rows)] = starts[:, None] + offsets
    positions = torch.where(real, positions, 0).reshape(-1)
    input_ids = torch.zeros(batch, seq, dtype=torch.int64)
    input_ids[real] = flat_ids

    flat_real = real.reshape(-1)
    req_indices = torch.arange(batch).repeat_interleave(seq)
    slot_mapping = torch.full((batch * seq,), PAD_SLOT_ID, dtype=torch.int64)
    real_slots = compute_slot_mapping(table, req_indices[flat_real], positions[flat_real], block_size)
    if real_slots.unique().numel() != real_slots.numel():
        raise ValueError("two real tokens of the step map to the same cache slot (a block is listed twice)")
    slot_mapping[flat_real] = real_slots

    cache_lens = torch.zeros(batch, dtype=torch.int64)
    cache_lens[: len(rows)] = starts
    if sample_every_token:
        num_samples = len(rows) * seq
        tokens = torch.arange(batch * seq, dtype=torch.int64)
        sampling = torch.where(flat_real, tokens, tokens // seq * seq)  # pads: their row's token 0
    else:
        sampling = torch.arange(batch, dtype=torch.int64) * seq
        sampling[: len(rows)] += lens - 1
        num_samples = len(rows)
    return StepInputs(
        input_ids=input_ids.reshape(-1),
        positions=positions,
        slot_mapping=slot_mapping,
        block_table=remap_null_block_to_sentinel(table),
        cache_lens=cache_lens,
        sampling_positions=sampling,
        num_rows=len(rows),
        num_samples=num_samples,
    )
