"""Padding steps to bucket shapes: the worked example's layouts bit for bit, a property test, refusals."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_buckets.core.bucket import Bucket, NoBucketFits, select_bucket
from neuron_buckets.core.padding import PaddedCall, pad_decode, pad_prefill
from neuron_buckets.engine.block_pool import BlockPool
from tests.conftest import segment


def test_seed_prefill_100_tokens_padded_to_128():
    tokens = list(range(1000, 1100))
    step = pad_prefill([segment(tokens, 0, [10, 15])], Bucket("prefill", 1, 128, 256), 64)
    assert step.slot_mapping.tolist() == [*range(640, 704), *range(960, 996)] + [-1] * 28
    assert step.positions.tolist() == list(range(100)) + [0] * 28
    assert step.input_ids.tolist() == tokens + [0] * 28
    assert step.block_table.tolist() == [[10, 15, -1, -1]]
    assert step.cache_lens.tolist() == [0]
    assert step.sampling_positions.tolist() == [99]  # the last real token, not the last pad
    assert step.segment_ids.flatten().tolist() == [0] * 100 + [1] * 28  # pads: a segment of their own
    assert (step.num_rows, step.num_samples) == (1, 1)
    order = (step.input_ids, step.positions, step.slot_mapping, step.block_table, step.cache_lens,
             step.segment_ids, step.sampling_positions)  # fmt: skip
    assert len(step.args()) == len(order)
    assert all(a is b for a, b in zip(step.args(), order, strict=True))  # the graph's input order
    assert all(t.dtype == torch.int64 for t in step.args())


def test_seed_prefill_scheduler_table_with_zeros_is_remapped():
    # The worked example's "Block Table: [10, 15, 0, 0, ...]" as a scheduler emits it.
    step = pad_prefill([segment([5] * 100, 0, [10, 15, 0, 0])], Bucket("prefill", 1, 128, 256), 64)
    assert step.block_table.tolist() == [[10, 15, -1, -1]]
    assert step.slot_mapping[99] == 995 and step.slot_mapping[100] == -1


def test_seed_decode_bucket_8_with_2_active_requests():
    rows = [segment([7], 50, [10]), segment([9], 75, [8, 12])]
    step = pad_decode(rows, Bucket("decode", 8, 1, 256), 64)
    assert step.input_ids.tolist() == [7, 9, 0, 0, 0, 0, 0, 0]
    assert step.positions.tolist() == [50, 75, 0, 0, 0, 0, 0, 0]
    assert step.slot_mapping.tolist() == [690, 779, -1, -1, -1, -1, -1, -1]  # 10*64+50, 12*64+11
    for t in (step.input_ids, step.positions, step.slot_mapping, step.cache_lens):
        assert t.shape == (8,)
    assert step.block_table.shape == (8, 256 // 64)
    assert step.block_table[:2].tolist() == [[10, -1, -1, -1], [8, 12, -1, -1]]
    assert (step.block_table[2:] == step.block_table[0]).all()  # dummies point at a valid row
    assert step.cache_lens.tolist() == [50, 75, 0, 0, 0, 0, 0, 0]
    assert step.real_sampling_positions.tolist() == [0, 1]
    assert step.sampling_positions.tolist() == list(range(8))  # S = 1: token 0 of each row
    assert step.segment_ids.flatten().tolist() == [0] * 8  # decode: one request per row
    assert (step.num_rows, step.num_samples) == (2, 2)


def test_packed_prefill_of_two_chunks_and_a_pad_tail():
    # Chunk 0 continues a chunked prompt at 6..8; chunk 1 is a fresh prompt of 5 tokens, packed
    # right behind it in one run of 16 tokens; the bucket holds up to 3 requests.
    chunks = [segment([6, 7, 8], 6, [4, 7, 2]), segment([1, 2, 3, 4, 5], 0, [3, 9])]
    bucket = Bucket("prefill", 3, 16, 16)
    step = pad_prefill(chunks, bucket, block_size=4)
    pad8 = [-1] * 8
    assert step.input_ids.tolist() == [6, 7, 8, 1, 2, 3, 4, 5] + [0] * 8  # end to end, padded at the tail
    assert step.positions.tolist() == [6, 7, 8, 0, 1, 2, 3, 4] + [0] * 8
    assert step.slot_mapping.tolist() == [30, 31, 8, 12, 13, 14, 15, 36, *pad8]  # 7*4+2, 7*4+3, 2*4
    assert step.segment_ids.flatten().tolist() == [0, 0, 0, 1, 1, 1, 1, 1] + [2] * 8  # pads: segment 2
    assert step.block_table.tolist() == [[4, 7, 2, -1], [3, 9, -1, -1], [-1] * 4]  # a row per segment
    assert step.cache_lens.tolist() == [6, 0, 0]  # each segment's start; the spare row's none
    assert step.sampling_positions.tolist() == [2, 7, 0]  # each chunk's last token; pad entry 0
    assert step.real_sampling_positions.tolist() == [2, 7]
    assert (step.num_rows, step.num_samples) == (2, 2)
    for t in (step.input_ids, step.positions, step.slot_mapping):
        assert t.shape == (bucket.seq,) == (bucket.tokens,)  # seq is the total, not per request
    assert step.segment_ids.shape == (1, bucket.seq)  # one packed step row
    assert all(t.dtype == torch.int64 for t in step.args())


def test_every_packed_segment_continues_its_own_context_and_returns_its_samples():
    # A continuing chunk, a fresh prompt, a decode row riding along (all its tokens sampled) and a
    # chunk that does not end its prompt (no sample), in one run of 16 with 8 sample entries.
    chunks = [segment([6, 7, 8], 6, [4, 7, 2]), segment([1, 2, 3, 4, 5], 0, [3, 9]),
              segment([9, 10], 5, [5, 6], 2), segment([1, 2], 3, [8, 10], 0)]  # fmt: skip
    step = pad_prefill(chunks, Bucket("prefill", 4, 16, 16), block_size=4, samples=8)
    assert step.block_table.tolist() == [[4, 7, 2, -1], [3, 9, -1, -1], [5, 6, -1, -1], [8, 10, -1, -1]]
    assert step.cache_lens.tolist() == [6, 0, 5, 3]
    assert step.positions.tolist() == [6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 3, 4] + [0] * 4
    assert step.slot_mapping.tolist()[8:12] == [25, 26, 35, 40]  # 6*4+1, 6*4+2, 8*4+3, 10*4+0
    assert step.segment_ids.flatten().tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 3] + [4] * 4
    assert step.sampling_positions.tolist() == [2, 7, 8, 9, 0, 0, 0, 0]
    assert step.num_samples == 4
    # more samples than one head call returns: two groups of 3, one head call each
    step = pad_prefill(chunks, Bucket("prefill", 4, 16, 16), block_size=4, samples=3)
    assert step.sampling_positions.tolist() == [2, 7, 8, 9, 0, 0]
    assert step.num_samples == 4


def test_a_chunk_returning_its_prompt_logits_samples_every_token_in_order():
    chunks = [segment([1, 2, 3, 4, 5], 0, [3, 9], 5), segment([6, 7], 4, [1, 2], 1)]
    step = pad_prefill(chunks, Bucket("prefill", 2, 16, 16), block_size=4, samples=2)
    assert step.sampling_positions.tolist() == [0, 1, 2, 3, 4, 6]  # three head calls of 2
    assert step.num_samples == 6
    with pytest.raises(ValueError, match="samples at most"):
        pad_prefill([segment([1, 2], 0, [3], 3)], Bucket("prefill", 2, 16, 16), block_size=4)


def test_packed_prefill_refuses_more_tokens_or_requests_than_the_bucket_holds():
    chunks = [segment([1] * 10, 0, [1, 2, 3]), segment([2] * 7, 0, [4, 5])]
    with pytest.raises(NoBucketFits, match=r"17 tokens do not fit bucket prefill_s16 \(16 tokens\)"):
        pad_prefill(chunks, Bucket("prefill", 2, 16, 16), block_size=4)
    three = [segment([i], 0, [i]) for i in (1, 2, 3)]
    with pytest.raises(NoBucketFits, match=r"3 requests do not fit bucket prefill_s16 \(at most 2\)"):
        pad_prefill(three, Bucket("prefill", 2, 16, 16), block_size=4)


def test_speculative_decode_rows_cross_the_block_boundary():
    # The worked example's base token at 62 plus 3 drafts, beside a request crossing at 127 -> 128.
    rows = [segment([1, 2, 3, 4], 62, [10, 15]), segment([5, 6, 7, 8], 125, [3, 5, 7])]
    step = pad_decode(rows, Bucket("decode", 4, 4, 256), 64)
    assert step.slot_mapping.tolist() == [702, 703, 960, 961, 381, 382, 383, 448] + [-1] * 8
    assert step.positions.tolist() == [62, 63, 64, 65, 125, 126, 127, 128] + [0] * 8
    assert step.cache_lens.tolist() == [62, 125, 0, 0]
    assert step.real_sampling_positions.tolist() == list(range(8))  # every draft is verified
    assert step.sampling_positions.tolist() == list(range(8)) + [8] * 4 + [12] * 4
    assert (step.num_rows, step.num_samples) == (2, 8)


def test_dummy_rows_allocate_nothing_and_copy_row_0():
    pool = BlockPool(num_blocks=64, block_size=16)
    a, b = pool.grow([], 41), pool.grow([], 20)  # actual tokens only: 3 + 2 blocks
    free_before = pool.num_free
    step = pad_decode([segment([1], 40, a), segment([2], 19, b)], Bucket("decode", 8, 1, 64), 16)
    assert pool.num_free == free_before == 63 - 5
    used = set(step.block_table.flatten().tolist()) - {-1}
    assert used == {*a, *b}
    assert (step.block_table[2:] == step.block_table[0]).all()
    assert (step.slot_mapping[2:] == -1).all() and (step.cache_lens[2:] == 0).all()


def reference_step(rows, bucket: Bucket, block_size: int, decode: bool) -> dict[str, list]:
    """The worked example's layout token by token in plain Python, to check the vectorised padding against."""
    max_blocks = bucket.ctx // block_size

    def table_row(row) -> list[int]:
        blocks = [b if b > 0 else -1 for b in row.block_ids][:max_blocks]
        return blocks + [-1] * (max_blocks - len(blocks))

    def slot(row, p: int) -> int:
        return row.block_ids[p // block_size] * block_size + p % block_size

    ids, pos, slots, segment, table, lens, sampling = [], [], [], [], [], [], []
    if not decode:  # packed: chunks end to end in one run, pads at the tail; a table row each
        spare = bucket.batch - len(rows)
        for i, row in enumerate(rows):
            for j, token in enumerate(row.token_ids):
                ids.append(token)
                pos.append(row.context_len + j)
                slots.append(slot(row, row.context_len + j))
                segment.append(i)
            sampling.append(len(ids) - 1)
        pads = bucket.seq - len(ids)
        return dict(input_ids=ids + [0] * pads, positions=pos + [0] * pads, slot_mapping=slots + [-1] * pads,
                    segment_ids=segment + [len(rows)] * pads,
                    block_table=[table_row(r) for r in rows] + [[-1] * max_blocks] * spare,
                    cache_lens=[r.context_len for r in rows] + [0] * spare,
                    sampling_positions=sampling + [0] * (bucket.batch - len(rows)))  # fmt: skip
    for r in range(bucket.batch):
        row = rows[r] if r < len(rows) else rows[0]
        table.append(table_row(row))
        real = r < len(rows)
        lens.append(row.context_len if real else 0)
        for j in range(bucket.seq):
            if real and j < len(row.token_ids):
                p = row.context_len + j
                ids.append(row.token_ids[j])
                pos.append(p)
                slots.append(slot(row, p))
            else:
                ids.append(0)
                pos.append(0)
                slots.append(-1)
            segment.append(0)
        n_real = len(row.token_ids) if real else 0
        sampling += [r * bucket.seq + (j if j < n_real else 0) for j in range(bucket.seq)]
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, segment_ids=segment, block_table=table,
                cache_lens=lens, sampling_positions=sampling)  # fmt: skip


@st.composite
def steps(draw):
    """Random real rows over shuffled physical blocks, padded to a random larger bucket.

    Decode: one row per request. Prefill: chunks packed into one run, each over its own context."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    decode = draw(st.booleans())
    n = draw(st.integers(1, 4))
    longest = draw(st.integers(1, 6 if decode else 24))
    lens = [draw(st.integers(1, longest)) for _ in range(n)]
    starts = [draw(st.integers(0, 40)) for _ in range(n)]
    needed = [-(-(s + n_tok) // block_size) for s, n_tok in zip(starts, lens, strict=True)]
    max_blocks = max(needed) + draw(st.integers(0, 2))
    physical = draw(st.permutations(range(1, sum(needed) + 1)))  # distinct blocks, any order
    rows, used = [], 0
    for start, length, k in zip(starts, lens, needed, strict=True):
        tokens = draw(st.lists(st.integers(1, 32000), min_size=length, max_size=length))
        trailing_zeros = [0] * draw(st.integers(0, max_blocks - k))  # scheduler-style unused entries
        rows.append(segment(tokens, start, list(physical[used : used + k]) + trailing_zeros))
        used += k
    batch = n + draw(st.integers(0, 3))  # dummy rows / unused request slots
    seq = longest if decode else sum(lens) + draw(st.integers(0, 8))  # prefill: a padded tail
    bucket = Bucket("decode" if decode else "prefill", batch, seq, max_blocks * block_size)
    return rows, bucket, block_size, decode


@given(steps())
@settings(max_examples=200, deadline=None)
def test_padding_matches_the_reference_and_keeps_the_slot_invariants(case):
    rows, bucket, block_size, decode = case
    step: PaddedCall = (pad_decode if decode else pad_prefill)(rows, bucket, block_size)
    want = reference_step(rows, bucket, block_size, decode)
    for name, expected in want.items():
        got = getattr(step, name)
        assert (got.flatten() if name == "segment_ids" else got).tolist() == expected, name
    slots = step.slot_mapping
    assert slots.shape == (bucket.tokens,)
    if decode:
        real = torch.zeros(bucket.batch, bucket.seq, dtype=torch.bool)
        for r, row in enumerate(rows):
            real[r, : len(row.token_ids)] = True
        real = real.flatten()
    else:
        real = torch.arange(bucket.seq) < sum(len(row.token_ids) for row in rows)
        assert (step.segment_ids[0][~real] == len(rows)).all()  # pads attend to no request
        last = step.real_sampling_positions
        assert step.segment_ids[0][last].tolist() == list(range(len(rows)))  # one sample per request...
        after = step.segment_ids[0][(last + 1).clamp(max=bucket.seq - 1)]
        assert ((after != step.segment_ids[0][last]) | (last == bucket.seq - 1)).all()  # ...its last token
    assert (slots[~real] == -1).all()  # a pad maps to -1 and nothing else
    assert (slots[real] >= block_size).all()  # a real token never lands on -1 or the null block
    assert slots[real].unique().numel() == int(real.sum())  # no two real tokens share a slot
    assert step.num_rows == len(rows)
    assert step.num_samples == (len(rows) * bucket.seq if decode else len(rows))


def test_a_request_larger_than_every_bucket_is_refused():
    with pytest.raises(NoBucketFits, match="no bucket fits 129: the largest bucket is 128"):
        select_bucket([32, 64, 128], 129)
    with pytest.raises(NoBucketFits, match=r"129 tokens do not fit bucket prefill_s128 \(128 tokens\)"):
        pad_prefill([segment([1] * 129, 0, [1, 2, 3])], Bucket("prefill", 1, 128, 256), 64)


def test_more_requests_than_rows_are_refused():
    rows = [segment([1], 0, [b]) for b in (1, 2, 3)]
    with pytest.raises(NoBucketFits, match=r"3 requests do not fit bucket decode_b2_c64 \(batch 2\)"):
        pad_decode(rows, Bucket("decode", 2, 1, 64), 16)


def test_context_beyond_the_bucket_is_refused():
    with pytest.raises(NoBucketFits, match=r"context 65 exceeds bucket decode_b1_c64 \(ctx 64\)"):
        pad_decode([segment([1], 64, [1, 2, 3, 4, 5])], Bucket("decode", 1, 1, 64), 16)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "at least one request"),
        ([segment([], 0, [1])], "at least one token"),
        ([segment([1], -1, [1])], r"start positions must be >= 0, got \[-1\]"),
        # A hole under the context would read the null block as if it held the prompt's K/V.
        ([segment([1], 20, [0, 2])], r"request 0 covers positions \[0, 21\).*logical block 0"),
        ([segment([1] * 4, 0, [3]), segment([2] * 4, 0, [3])], "same cache slot"),
        ([segment([1] * 20, 0, [3, 3])], "same cache slot"),
    ],
)
def test_bad_prefill_steps_are_refused(rows, message):
    with pytest.raises(ValueError, match=message):
        pad_prefill(rows, Bucket("prefill", 2, 32, 64), 16)


def test_short_decode_rows_sample_token_0_in_place_of_their_pads():
    # A plain decode token in a speculation bucket: its row's pad entries are sampled as token 0.
    rows = [segment([1, 2, 3, 4], 10, [1]), segment([5], 10, [2])]
    step = pad_decode(rows, Bucket("decode", 3, 4, 64), 16)
    assert step.slot_mapping.tolist() == [26, 27, 28, 29, 42, -1, -1, -1] + [-1] * 4
    assert step.sampling_positions.tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 8, 8, 8, 8]
    assert step.num_samples == 8  # the real rows' entries, row by row
