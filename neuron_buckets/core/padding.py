"""Padding a step to a bucket's fixed shape without ever touching real KV data.

Decode: ``batch`` block-table rows of ``seq`` (1 + speculation_length) token positions each,
flattened row-major; dummy rows copy row 0's block table (they allocate nothing) and have cache
length 0. Packed: the segments of several requests (prefill chunks, decode rows) laid end to end
in one run of ``seq`` tokens, padded only at the tail, told apart by ``segment_ids``; segment g
reads block-table row g and its own cache length, so any segment may continue a cached context.
Pad tokens get position 0, slot -1 (they write nothing) and a segment of their own past the real
ones; only real tokens are sampled. Blocks are
allocated by the caller for actual tokens only, so padding never needs a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
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
from neuron_buckets.core.step_plan import Segment


@dataclass(frozen=True)
class PaddedCall:
    """One graph call padded to its bucket's fixed shape: the inputs every piece of the call
    takes, all tensors int64."""

    input_ids: Tensor  # (T,) with T = batch * seq
    positions: Tensor  # (T,)
    slot_mapping: Tensor  # (T,)
    block_table: Tensor  # (R, ctx // block_size), a row per request; -1 for unused entries
    cache_lens: Tensor  # (R,) tokens already cached before this step
    segment_ids: Tensor  # (B, S): decode (R, seq) zeros; packed (1, seq), segment g over row g
    sampling_positions: Tensor  # (N,) flat token indices whose logits come back, head call by head call
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
            self.segment_ids,
            self.sampling_positions,
        )

    @property
    def real_sampling_positions(self) -> Tensor:
        return self.sampling_positions[: self.num_samples]

    @property
    def fresh(self) -> bool:
        """Nothing cached before this step: no row reads a context."""
        return not bool(self.cache_lens.any())

    def without_context(self) -> PaddedCall:
        """The inputs of a fresh step as a layer piece over no context takes them: a block table
        of no columns (the slots the step writes are already in ``slot_mapping``)."""
        return replace(self, block_table=self.block_table[:, :0])


def pad_prefill(
    chunks: Sequence[Segment], bucket: Bucket, block_size: int, samples: int | None = None
) -> PaddedCall:
    """Segments (each the part of a plan's segment that one call runs) end to end in
    ``bucket.seq`` tokens, at most ``bucket.batch`` of them, segment g over block-table row g; the
    logits of each one's last ``num_samples`` tokens are sampled, in segment order, into
    ``samples`` entries (``bucket.batch`` unless given: what one head call returns), or into as
    many groups of ``samples`` as they need (a chunk that returns its prompt's logits: the runtime
    runs the head once per group)."""
    if not chunks:
        raise ValueError("a step needs at least one request")
    if len(chunks) > bucket.batch:
        raise NoBucketFits(f"{len(chunks)} requests do not fit bucket {bucket.name} (at most {bucket.batch})")
    flat_ids, lens = _ragged([c.token_ids for c in chunks])
    if int(lens.min()) == 0:
        raise ValueError("every request in a step needs at least one token")
    total = int(lens.sum())
    if total > bucket.seq:
        raise NoBucketFits(f"{total} tokens do not fit bucket {bucket.name} ({bucket.seq} tokens)")
    starts = torch.tensor([c.context_len for c in chunks], dtype=torch.int64)
    if int(starts.min()) < 0:
        raise ValueError(f"start positions must be >= 0, got {starts.tolist()}")
    wanted = torch.tensor([c.num_samples for c in chunks], dtype=torch.int64)
    samples = bucket.batch if samples is None else samples
    if bool(((wanted < 0) | (wanted > lens)).any()):
        raise ValueError(f"samples {wanted.tolist()}: a segment samples at most its {lens.tolist()} tokens")
    table = torch.full((bucket.batch, bucket.ctx // block_size), NULL_BLOCK_ID, dtype=torch.int64)
    table[: len(chunks)] = _block_rows(chunks, starts, lens, bucket, block_size)
    segment = torch.repeat_interleave(torch.arange(len(chunks)), lens)
    ends = lens.cumsum(0)
    offsets = torch.arange(total) - (ends - lens)[segment]
    positions = starts[segment] + offsets
    slots = _real_slots(table, segment, positions, block_size)

    def padded(real: Tensor, fill: int, size: int = bucket.seq) -> Tensor:
        return torch.cat([real, torch.full((size - real.numel(),), fill, dtype=torch.int64)])

    # each segment's last ``wanted`` tokens: count back from its end
    owner = torch.repeat_interleave(torch.arange(len(chunks)), wanted)
    back = torch.arange(int(wanted.sum())) - (wanted.cumsum(0) - wanted)[owner]
    groups = max(1, -(-int(wanted.sum()) // samples))
    cache_lens = torch.zeros(bucket.batch, dtype=torch.int64)
    cache_lens[: len(chunks)] = starts
    return PaddedCall(
        input_ids=padded(flat_ids, 0),
        positions=padded(positions, 0),
        slot_mapping=padded(slots, PAD_SLOT_ID),
        block_table=remap_null_block_to_sentinel(table),
        cache_lens=cache_lens,
        segment_ids=padded(segment, len(chunks))[None],
        sampling_positions=padded(ends[owner] - wanted[owner] + back, 0, samples * groups),
        num_rows=len(chunks),
        num_samples=int(wanted.sum()),
    )


def pad_decode(rows: Sequence[Segment], bucket: Bucket, block_size: int) -> PaddedCall:
    """One row per request of up to ``1 + speculation_length`` tokens; every real token is sampled.

    The first ``num_rows * seq`` samples are the real rows, row by row; a short row's pad entries
    point at its token 0, so a caller slicing per row never reads a pad token's logits.
    """
    batch, seq = bucket.batch, bucket.seq
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
    starts = torch.tensor([r.context_len for r in rows], dtype=torch.int64)
    if int(starts.min()) < 0:
        raise ValueError(f"start positions must be >= 0, got {starts.tolist()}")
    table = torch.empty(batch, bucket.ctx // block_size, dtype=torch.int64)
    table[: len(rows)] = _block_rows(rows, starts, lens, bucket, block_size)
    table[len(rows) :] = table[0]

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
    slot_mapping[flat_real] = _real_slots(table, req_indices[flat_real], positions[flat_real], block_size)

    cache_lens = torch.zeros(batch, dtype=torch.int64)
    cache_lens[: len(rows)] = starts
    tokens = torch.arange(batch * seq, dtype=torch.int64)
    return PaddedCall(
        input_ids=input_ids.reshape(-1),
        positions=positions,
        slot_mapping=slot_mapping,
        block_table=remap_null_block_to_sentinel(table),
        cache_lens=cache_lens,
        segment_ids=torch.zeros(batch, seq, dtype=torch.int64),  # one request per row
        sampling_positions=torch.where(flat_real, tokens, tokens // seq * seq),  # pads: row's token 0
        num_rows=len(rows),
        num_samples=len(rows) * seq,
    )


def _ragged(lists: Sequence[Sequence[int] | Tensor]) -> tuple[Tensor, Tensor]:
    """Concatenate per-request id lists into one tensor (one conversion, not one per request)."""
    lens = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    if all(isinstance(x, Tensor) for x in lists):
        return torch.cat([x.reshape(-1) for x in lists]).to(torch.int64), lens
    plain = [x.tolist() if isinstance(x, Tensor) else x for x in lists]
    flat = plain[0] if len(plain) == 1 else list(chain.from_iterable(plain))
    return torch.as_tensor(flat, dtype=torch.int64), lens


def _block_rows(
    rows: Sequence[Segment], starts: Tensor, lens: Tensor, bucket: Bucket, block_size: int
) -> Tensor:
    """(rows, ctx // block_size) block table of the real rows, 0 (null) where unused, checked."""
    max_blocks = bucket.ctx // block_size
    if int((starts + lens).max()) > bucket.ctx:
        raise NoBucketFits(
            f"context {int((starts + lens).max())} exceeds bucket {bucket.name} (ctx {bucket.ctx})"
        )
    table = torch.full((len(rows), max_blocks), NULL_BLOCK_ID, dtype=torch.int64)
    flat_blocks, counts = _ragged([r.block_ids[:max_blocks] for r in rows])
    row_of = torch.repeat_interleave(torch.arange(len(rows)), counts)
    first = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    table[row_of, torch.arange(flat_blocks.numel()) - first] = flat_blocks
    # Every block under a row's context must be allocated: attention reads [0, start) from the
    # cache, and a hole there would silently read the null block as if it held real K/V.
    needed = -(-(starts + lens) // block_size)
    holes = (torch.arange(max_blocks) < needed[:, None]) & (table <= NULL_BLOCK_ID)
    if bool(holes.any()):
        r, col = (int(i) for i in holes.nonzero()[0])
        raise ValueError(
            f"request {r} covers positions [0, {int(starts[r] + lens[r])}) but its logical block {col} "
            f"is unallocated (entry {int(table[r, col])}); allocate blocks before padding"
        )
    return table


def _real_slots(table: Tensor, rows: Tensor, positions: Tensor, block_size: int) -> Tensor:
    slots = compute_slot_mapping(table, rows, positions, block_size)
    if slots.unique().numel() != slots.numel():
        raise ValueError("two real tokens of the step map to the same cache slot (a block is listed twice)")
    return slots
