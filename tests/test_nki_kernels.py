"""The NKI block-KV kernels: their torch glue everywhere, the kernels under ``nki.simulate``.

The glue (slot ids, masks, layouts, the golden fallback) is plain torch and is tested on every
machine. The kernels themselves need the ``nki`` package of the AWS Neuron SDK; without it those
tests skip with the reason. The goldens' own tests live in test_kernels_golden.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neuron_buckets.backends.neuron import offset_to_layer
from neuron_buckets.core.block_table import compute_slot_mapping
from neuron_buckets.kernels import block_kv_nki, block_kv_torch, nki_ops
from neuron_buckets.kernels.attention_step import AttentionStep

NO_NKI = (
    "needs the nki package (AWS Neuron SDK 2.29+, NKI 0.3) to run nki.simulate: "
    "pip install neuronx-cc nki --extra-index-url https://pip.repos.neuron.amazonaws.com"
)


def step_case(batch, seq, heads, kv_heads, head_dim, block_size, cols, seed=0):
    """A block-KV step: tables with -1 tails, NaN and 3e38 garbage wherever nothing may be read."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = batch * cols + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    table = torch.full((batch, cols), -1, dtype=torch.int64)
    lens = torch.randint(0, cols * block_size + 1, (batch,), generator=g)
    lens[0] = cols * block_size  # one full row: every tile of the context is live
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 is the null block
    for b, n in enumerate(lens.tolist()):
        used = -(-n // block_size)
        table[b, :used] = torch.tensor([free.pop() for _ in range(used)], dtype=torch.int64)
        for p in range(n, used * block_size):  # stale tail of the last block
            k_cache[table[b, p // block_size], p % block_size] = float("nan")
            v_cache[table[b, p // block_size], p % block_size] = 3e38
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    q = torch.randn(batch, seq, heads, head_dim, generator=g)
    k_act = torch.randn(batch, seq, kv_heads, head_dim, generator=g)
    v_act = torch.randn(batch, seq, kv_heads, head_dim, generator=g)
    segments = torch.zeros(batch, seq, dtype=torch.int64)  # decode rows: one request each
    return q, k_act, v_act, k_cache, v_cache, AttentionStep(table, lens, segments)


def test_context_slots_follow_the_block_table_and_stop_at_the_cache_length():
    # The worked prefill example: blocks 10 and 15, block_size 64, 100 tokens cached.
    table = torch.tensor([[10, 15, -1, -1], [-1, -1, -1, -1]])
    slots = nki_ops.context_slots(table, torch.tensor([100, 0]), 64)
    assert slots.shape == (2, 256, 1) and slots.dtype == torch.int32
    row = slots[0, :, 0]
    assert row[:64].tolist() == list(range(640, 704))
    assert row[64:100].tolist() == list(range(960, 996))
    assert (row[100:] == -1).all() and (slots[1] == -1).all()
    expected = compute_slot_mapping(table[:1], torch.zeros(100, dtype=torch.int64), torch.arange(100), 64)
    assert torch.equal(row[:100].long(), expected)


@pytest.mark.parametrize("window", [None, 2])
def test_kernel_inputs_group_query_heads_by_kv_head_with_matching_masks(window):
    """The kernel's masks are the golden's, sliding window included: it needs no window itself."""
    batch, seq, heads, kv_heads, head_dim, bs, cols = 2, 3, 4, 2, 8, 4, 2
    q, k_act, v_act, _, _, step = step_case(batch, seq, heads, kv_heads, head_dim, bs, cols)
    segments = torch.tensor([[0, 0, 0], [0, 1, 1]])  # row 1 packs two requests
    lens = step.cache_lens
    q_k, k_k, v_k, slots, mask_cache, mask_active = nki_ops.attention_kernel_inputs(
        q, k_act, v_act, step._replace(segment_ids=segments), bs, window
    )
    reach = window or bs * cols + seq  # positions back a token may look
    group = heads // kv_heads
    assert q_k.shape == (batch, kv_heads, group * seq, head_dim)
    for b in range(batch):
        for g in range(kv_heads):
            assert torch.equal(k_k[b, g], k_act[b, :, g]) and torch.equal(v_k[b, g], v_act[b, :, g])
            for j in range(group):
                for s in range(seq):
                    r = j * seq + s  # row of query head g*group + j at step token s
                    assert torch.equal(q_k[b, g, r], q[b, s, g * group + j])
                    seg = segments[b]
                    live = (torch.arange(bs * cols) < lens[b]) & (seg[s] == 0)
                    live &= lens[b] + s - torch.arange(bs * cols) < reach
                    assert torch.equal(mask_cache[b, g, r].bool(), live)
                    sees = (torch.arange(seq) <= s) & (seg == seg[s]) & (s - torch.arange(seq) < reach)
                    assert torch.equal(mask_active[b, g, r].bool(), sees)
    assert mask_cache.dtype == mask_active.dtype == torch.uint8


def test_steps_beyond_the_kernel_tiles_run_the_golden():
    # A 256-token prefill chunk has 512 query rows per kv head: more than one 128-row tile.
    case = step_case(1, 256, 4, 2, 8, 16, 16)
    assert not nki_ops.attention_kernel_fits(case[0].shape, 2, 256)
    assert nki_ops.attention_kernel_fits((8, 5, 32, 128), 8, 4096)
    assert not nki_ops.attention_kernel_fits((8, 1, 8, 256), 8, 4096)  # head_dim > 128
    got = nki_ops.block_kv_attention(*case, scale=0.125)
    assert torch.equal(got, block_kv_torch.block_kv_attention(*case, scale=0.125))


def test_kernel_call_without_the_sdk_names_what_to_install():
    if block_kv_nki.nki is not None:
        pytest.skip("nki is importable here")
    case = step_case(2, 1, 4, 2, 8, 16, 8)
    with pytest.raises(block_kv_nki.NkiUnavailable, match="pip install .*nki"):
        nki_ops.block_kv_attention(*case, scale=0.125)


@pytest.mark.neuron
def test_stacked_layer_write_matches_the_golden():
    nki = pytest.importorskip("nki", reason=NO_NKI)
    layers, num_blocks, block_size = 3, 6, 16
    slots = torch.tensor([17, 18, -1, 40, -1, 95])
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    caches = [torch.randn(layers, num_blocks, block_size, 2, 8) for _ in range(2)]
    golden = [c.clone() for c in caches]
    block_kv_torch.write_kv_cache(k, v, golden[0][1], golden[1][1], slots)
    k_np, v_np = (c.reshape(layers * num_blocks, block_size, 2, 8).numpy().copy() for c in caches)
    table = torch.zeros(1, 1, dtype=torch.int64)
    layer_slots, _ = offset_to_layer(torch.tensor(1), slots, table, num_blocks, block_size)
    rows = layer_slots.to(torch.int32).reshape(-1, 1).numpy()
    nki.simulate(block_kv_nki.write_kv_cache_kernel)(k.numpy(), v.numpy(), k_np, v_np, rows)
    assert np.array_equal(k_np, golden[0].reshape(k_np.shape).numpy())
    assert np.array_equal(v_np, golden[1].reshape(v_np.shape).numpy())


@pytest.mark.parametrize("tokens", [128, 300])
@pytest.mark.neuron
def test_write_kernel_matches_the_golden_and_skips_pad_slots(tokens):
    nki = pytest.importorskip("nki", reason=NO_NKI)
    block_size, num_blocks = 64, 16
    table = torch.tensor([[10, 15, 3, 7, 12, 1]])
    real = min(tokens - 28, 100 if tokens == 128 else 250)  # the worked example's 100 real of 128, padded
    slots = torch.full((tokens,), -1, dtype=torch.int64)
    slots[:real] = compute_slot_mapping(table, torch.zeros(real, dtype=torch.int64), torch.arange(real), 64)
    k, v = torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)
    caches = [torch.randn(num_blocks, block_size, 2, 8) for _ in range(2)]
    golden = [c.clone() for c in caches]
    block_kv_torch.write_kv_cache(k, v, *golden, slots)
    k_np, v_np = (c.numpy().copy() for c in caches)
    slots_np = slots.to(torch.int32).reshape(-1, 1).numpy()
    nki.simulate(block_kv_nki.write_kv_cache_kernel)(k.numpy(), v.numpy(), k_np, v_np, slots_np)
    # Bit-exact: real tokens landed where the golden put them, pads changed no byte anywhere.
    assert np.array_equal(k_np.view(np.int32), golden[0].numpy().view(np.int32))
    assert np.array_equal(v_np.view(np.int32), golden[1].numpy().view(np.int32))


@pytest.mark.parametrize(
    "batch,seq,heads,kv_heads,head_dim,block_size,cols,window",
    [
        (2, 1, 4, 2, 16, 16, 8, None),  # plain decode, GQA, one 128-position tile
        (3, 4, 8, 2, 32, 16, 16, None),  # speculative decode over two tiles, block boundaries inside
        (2, 3, 2, 2, 8, 4, 4, None),  # a 16-position context, smaller than one tile
        (1, 8, 4, 1, 64, 32, 8, None),  # all query heads on one kv head
        (3, 4, 8, 2, 32, 16, 16, 100),  # a sliding window shorter than the context (Mistral)
    ],
)
@pytest.mark.neuron
def test_attention_kernel_matches_the_golden(batch, seq, heads, kv_heads, head_dim, block_size, cols, window):
    nki = pytest.importorskip("nki", reason=NO_NKI)
    q, k_act, v_act, k_cache, v_cache, step = step_case(
        batch, seq, heads, kv_heads, head_dim, block_size, cols, seed=seq
    )
    scale = head_dim**-0.5
    want = block_kv_torch.block_kv_attention(q, k_act, v_act, k_cache, v_cache, step, scale, window)
    q_k, k_k, v_k, slots, mask_cache, mask_active = (
        t.numpy() for t in nki_ops.attention_kernel_inputs(q, k_act, v_act, step, block_size, window)
    )
    out = nki.simulate(block_kv_nki.block_kv_attention_kernel)(
        q_k, k_k, v_k, k_cache.numpy(), v_cache.numpy(), slots, mask_cache, mask_active, scale
    )
    got = torch.from_numpy(np.asarray(out)).reshape(batch, heads, seq, head_dim).permute(0, 2, 1, 3)
    assert torch.isfinite(got).all()  # NaN / 3e38 garbage outside cache_len never leaked in
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
