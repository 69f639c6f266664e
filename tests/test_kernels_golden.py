"""The torch kernel goldens on the block-KV worked examples and their invariants."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_buckets.core.block_table import compute_slot_mapping, remap_null_block_to_sentinel
from neuron_buckets.kernels import block_kv_cpu, block_kv_flex, block_kv_paged, block_kv_sdpa, block_kv_torch
from neuron_buckets.kernels.attention_step import AttentionStep
from neuron_buckets.kernels.block_kv_torch import block_kv_attention, write_kv_cache

KVH, D = 2, 8


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float32 tensor, so NaN == NaN and -0.0 != 0.0."""
    return t.view(torch.int32)


def garbage_cache(num_blocks: int, block_size: int) -> torch.Tensor:
    cache = torch.full((num_blocks, block_size, KVH, D), float("nan"))
    cache[1::2] = 3e38
    return cache


def write_example(block_table: list[int], positions: list[int], num_tokens: int, bs: int):
    """Write tokens 0..len(positions)-1 (padded to num_tokens with slot -1) into garbage caches."""
    table = torch.tensor([block_table])
    real = compute_slot_mapping(table, torch.zeros(len(positions), dtype=torch.int64),
                                torch.tensor(positions), bs)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    slots[: len(positions)] = real
    k = torch.randn(num_tokens, KVH, D)
    v = torch.randn(num_tokens, KVH, D)
    k_cache, v_cache = garbage_cache(16, bs), garbage_cache(16, bs)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots)
    return slots, k, v, (k_cache, before_k), (v_cache, before_v)


def test_prefill_example_100_tokens_padded_to_128():
    """Seed: 100 tokens in blocks [10, 15], block_size 64: 100 writes, 28 pads skip."""
    slots, k, v, (kc, kb), (vc, vb) = write_example([10, 15], list(range(100)), 128, 64)
    assert slots[:64].tolist() == list(range(640, 704))
    assert slots[64:100].tolist() == list(range(960, 996))
    assert (slots[100:] == -1).all()
    assert torch.equal(kc[10], k[:64]) and torch.equal(vc[10], v[:64])
    assert torch.equal(kc[15, :36], k[64:100]) and torch.equal(vc[15, :36], v[64:100])
    written = torch.zeros(16, 64, dtype=torch.bool)
    written[10] = True
    written[15, :36] = True
    assert torch.equal(bits(kc[~written]), bits(kb[~written]))  # incl. null block and 15[36:]
    assert torch.equal(bits(vc[~written]), bits(vb[~written]))


def test_speculative_decode_example_crosses_block_boundary():
    """Seed: positions 62..65 in blocks [10, 15] land in slots 702, 703, 960, 961."""
    slots, k, _, (kc, kb), _ = write_example([10, 15], [62, 63, 64, 65], 4, 64)
    assert slots.tolist() == [702, 703, 960, 961]
    assert torch.equal(kc[10, 62:64], k[:2]) and torch.equal(kc[15, :2], k[2:])
    kb[10, 62:64], kb[15, :2] = k[:2], k[2:]
    assert torch.equal(bits(kc), bits(kb))


def test_all_pad_step_writes_nothing():
    """A dummy decode row (every slot -1) leaves every cache byte, null block too, untouched."""
    kc, vc = garbage_cache(4, 8), garbage_cache(4, 8)
    kb, vb = kc.clone(), vc.clone()
    write_kv_cache(torch.randn(8, KVH, D), torch.randn(8, KVH, D), kc, vc,
                   torch.full((8,), -1, dtype=torch.int64))
    assert torch.equal(bits(kc), bits(kb)) and torch.equal(bits(vc), bits(vb))


def dense_reference(q, k_seq, v_seq, cache_len: int, scale: float, window: int | None = None) -> torch.Tensor:
    """One row's attention on contiguous (L, KVH, D) K/V: query i sits at cache_len + i and sees
    positions up to its own, only the last ``window`` of them with a sliding window."""
    s, h = q.shape[0], q.shape[1]
    length = cache_len + s
    k = k_seq[:length].repeat_interleave(h // KVH, dim=1).transpose(0, 1)
    v = v_seq[:length].repeat_interleave(h // KVH, dim=1).transpose(0, 1)
    back = (cache_len + torch.arange(s))[:, None] - torch.arange(length)[None, :]
    mask = (back >= 0) & (back < (window or length))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def paged_case(cache_lens: list[int], seq: int, bs: int, max_blocks: int, heads: int, seed: int):
    """Random rows laid out in shuffled physical blocks; returns kernel inputs and row K/V."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(cache_lens)
    num_blocks = 1 + batch * max_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, max_blocks)
    used = (torch.tensor(cache_lens)[:, None] + bs - 1) // bs > torch.arange(max_blocks)
    table = torch.where(used, perm, 0)
    k_seq = torch.randn(batch, max_blocks * bs + seq, KVH, D, generator=gen)
    v_seq = torch.randn(batch, max_blocks * bs + seq, KVH, D, generator=gen)
    q = torch.randn(batch, seq, heads, D, generator=gen)
    k_cache, v_cache = torch.zeros(num_blocks, bs, KVH, D), torch.zeros(num_blocks, bs, KVH, D)
    for b, n in enumerate(cache_lens):  # test setup: place each row's history in its blocks
        pos = torch.arange(n)
        k_cache[table[b, pos // bs], pos % bs] = k_seq[b, :n]
        v_cache[table[b, pos // bs], pos % bs] = v_seq[b, :n]
    k_act = torch.stack([k_seq[b, n : n + seq] for b, n in enumerate(cache_lens)])
    v_act = torch.stack([v_seq[b, n : n + seq] for b, n in enumerate(cache_lens)])
    return q, k_act, v_act, k_cache, v_cache, table, k_seq, v_seq


def poisoned(k_cache, v_cache, table, lens: list[int], bs: int, fill: float):
    """The caches with ``fill`` in every slot outside each row's context (the null block too)."""
    live = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        live[table[b, pos // bs], pos % bs] = True
    return (torch.where(live[..., None, None], c, fill) for c in (k_cache, v_cache))


def run_attention(case, cache_lens, scale=0.3, table=None, window=None):
    q, k_act, v_act, k_cache, v_cache, base_table, _, _ = case
    table = remap_null_block_to_sentinel(base_table) if table is None else table
    segments = torch.zeros(q.shape[:2], dtype=torch.int64)  # one request per row
    step = AttentionStep(table, torch.tensor(cache_lens), segments)
    return block_kv_attention(q, k_act, v_act, k_cache, v_cache, step, scale, window)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    seq=st.integers(1, 5),
    bs=st.sampled_from([4, 8, 16]),
    group=st.sampled_from([1, 2]),
    window=st.sampled_from([None, 1, 3, 16]),
    seed=st.integers(0, 2**16),
)
def test_attention_matches_dense_reference(lens, seq, bs, group, window, seed):
    """Paged context plus step tokens, with and without a sliding window (Mistral's) shorter than
    most contexts: exactly the dense attention over the row's contiguous history."""
    max_blocks = 40 // bs + 1
    case = paged_case(lens, seq, bs, max_blocks, KVH * group, seed)
    out = run_attention(case, lens, window=window)
    q, _, _, _, _, _, k_seq, v_seq = case
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b], dense_reference(q[b], k_seq[b], v_seq[b], n, 0.3, window),
                                   rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 30), min_size=1, max_size=3),
    seq=st.integers(1, 4),
    fill=st.sampled_from([float("nan"), float("inf"), -3e38, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_null_block_and_unwritten_slots_never_reach_the_output(lens, seq, fill, seed):
    """Garbage anywhere outside [0, cache_len) of each row leaves the output bit-identical."""
    bs, max_blocks = 8, 4
    case = paged_case(lens, seq, bs, max_blocks, KVH * 2, seed)
    clean = run_attention(case, lens)
    q, k_act, v_act, k_cache, v_cache, table, k_seq, v_seq = case
    dirty_k, dirty_v = poisoned(k_cache, v_cache, table, lens, bs, fill)
    dirty = run_attention((q, k_act, v_act, dirty_k, dirty_v, table, k_seq, v_seq), lens)
    assert torch.isfinite(clean).all()
    assert torch.equal(bits(dirty), bits(clean))


def test_sentinel_and_null_block_entries_read_alike():
    """-1 and 0 in unused table entries (before and after the remap) give identical outputs."""
    lens = [3, 17, 0]
    case = paged_case(lens, 2, 8, 4, 4, seed=1)
    raw = case[5]
    assert (raw == 0).any()
    assert torch.equal(run_attention(case, lens, table=raw), run_attention(case, lens))


def test_causal_among_active_tokens():
    """Token i of the step never sees step tokens after it: changing them leaves i unchanged."""
    lens = [5, 0]
    case = paged_case(lens, 4, 8, 2, 4, seed=2)
    out = run_attention(case, lens)
    q, k_act, v_act, *rest = case
    k2, v2 = k_act.clone(), v_act.clone()
    k2[:, 2:], v2[:, 2:] = 7.0, -7.0
    out2 = run_attention((q, k2, v2, *rest), lens)
    assert torch.equal(out[:, :2], out2[:, :2])
    assert not torch.allclose(out[:, 2:], out2[:, 2:])


@pytest.mark.parametrize("window", [None, 2, 5])
def test_packed_segments_attend_like_separate_requests(window):
    """One row holding two requests end to end: the first continues the row's cached context,
    the second starts fresh; each equals the dense reference of its own request alone. A sliding
    window counts positions within each request, the second's from 0."""
    bs, cached, first, second = 8, 11, 3, 4
    case = paged_case([cached], first + second, bs, 3, 4, seed=5)
    q, k_act, v_act, k_cache, v_cache, table, k_seq, v_seq = case
    segments = torch.tensor([[0] * first + [1] * second])
    step = AttentionStep(remap_null_block_to_sentinel(table), torch.tensor([cached]), segments)
    out = block_kv_attention(q, k_act, v_act, k_cache, v_cache, step, 0.3, window)
    end = cached + first
    ref_first = dense_reference(q[0, :first], k_seq[0, :end], v_seq[0, :end], cached, 0.3, window)
    ref_second = dense_reference(q[0, first:], k_act[0, first:], v_act[0, first:], 0, 0.3, window)
    torch.testing.assert_close(out[0, :first], ref_first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0, first:], ref_second, rtol=1e-5, atol=1e-5)


def test_layer_write_through_a_view_touches_only_that_layer():
    """The runtime's form: each layer piece writes its slice (a view) of the stacked caches."""
    stacked_k = garbage_cache(12, 8).view(3, 4, 8, KVH, D)
    stacked_v = garbage_cache(12, 8).view(3, 4, 8, KVH, D)
    alone_k, alone_v = stacked_k[1].clone(), stacked_v[1].clone()
    before_k, before_v = stacked_k.clone(), stacked_v.clone()
    k, v = torch.randn(5, KVH, D), torch.randn(5, KVH, D)
    slots = torch.tensor([9, 10, -1, 31, -1])
    write_kv_cache(k, v, stacked_k[1], stacked_v[1], slots)
    write_kv_cache(k, v, alone_k, alone_v, slots)
    assert torch.equal(bits(stacked_k[1]), bits(alone_k))
    assert torch.equal(bits(stacked_v[1]), bits(alone_v))
    for other in (0, 2):
        assert torch.equal(bits(stacked_k[other]), bits(before_k[other]))
        assert torch.equal(bits(stacked_v[other]), bits(before_v[other]))


# The fast paths: the C++ kernel, inductor's in-place decode loops, dense SDPA, flex.
FAST_PATHS = [block_kv_cpu, block_kv_paged, block_kv_sdpa, block_kv_flex]
FAST_IDS = ["cpu", "paged", "sdpa", "flex"]


# Eager flex attention (a reference implementation) warns that it is not the compiled kernel;
# the compiled one runs in every artifact test.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", FAST_PATHS, ids=FAST_IDS)
@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(0, 30), min_size=1, max_size=3),
    # decode rows of at most DENSE_ROWS tokens take the dense path, longer ones block-sparse flex
    seq=st.integers(1, 6) | st.integers(block_kv_flex.DENSE_ROWS + 1, block_kv_flex.DENSE_ROWS + 40),
    packed=st.booleans(),
    fill=st.sampled_from([float("nan"), 1e30]),
    window=st.sampled_from([None, 1, 4, 20]),
    seed=st.integers(0, 2**16),
)
def test_the_fast_attention_paths_agree_with_the_golden(kernel, lens, seq, packed, fill, window, seed):
    """The fast CPU paths (dense fused SDPA; block-sparse flex attention) against the readable
    golden: same masking (segments, context, sliding window, garbage outside it), outputs within
    float tolerance."""
    bs, max_blocks = 8, 5
    q, k_act, v_act, k_cache, v_cache, table, _, _ = paged_case(lens, seq, bs, max_blocks, KVH * 3, seed)
    k_cache[0], v_cache[0] = fill, fill  # the null block, read through -1 entries and masked
    gen = torch.Generator().manual_seed(seed)
    segments = torch.zeros(len(lens), seq, dtype=torch.int64)
    if packed:  # requests end to end in each row: sorted segment ids, segment 0 first
        segments = torch.randint(0, 3, (len(lens), seq), generator=gen).sort(dim=1).values
        segments -= segments[:, :1].clone()
    step = AttentionStep(remap_null_block_to_sentinel(table), torch.tensor(lens), segments)
    args = (q, k_act, v_act, k_cache, v_cache, step, 0.3, window)
    want = block_kv_attention(*args)
    got = kernel.block_kv_attention(*args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def packed_case(lens: list[int], counts: list[int], pads: int, seed: int, fill: float, bs: int = 8,
                max_blocks: int = 5):
    """One packed step row over ``len(lens)`` block-table rows: segment g continues the cached
    context of row g with ``counts[g]`` tokens; ``pads`` pad tokens (segment R) at the tail; the
    null block and every slot past a context hold ``fill``. Returns kernel args and references."""
    case = paged_case(lens, max(counts), bs, max_blocks, KVH * 3, seed)
    q, k_act, v_act, k_cache, v_cache, table, k_seq, v_seq = case
    k_cache, v_cache = poisoned(k_cache, v_cache, table, lens, bs, fill)
    gen = torch.Generator().manual_seed(seed)

    def packed(x: torch.Tensor) -> torch.Tensor:  # (R, seq, ...) -> (1, T, ...), pads random
        real = [x[g, :n] for g, n in enumerate(counts)]
        return torch.cat([*real, torch.randn(pads, *x.shape[2:], generator=gen)])[None]

    segments = torch.repeat_interleave(torch.arange(len(lens) + 1), torch.tensor([*counts, pads]))[None]
    step = AttentionStep(remap_null_block_to_sentinel(table), torch.tensor(lens), segments)
    refs = [(q[g, :n], k_seq[g], v_seq[g], lens[g]) for g, n in enumerate(counts)]
    return (packed(q), packed(k_act), packed(v_act), k_cache, v_cache, step), refs


PACKED = dict(
    lens=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    counts=st.lists(st.integers(1, 9), min_size=4, max_size=4),
    pads=st.integers(0, 3),
    fill=st.sampled_from([float("nan"), 1e30]),
    window=st.sampled_from([None, 1, 4, 20]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=25, deadline=None)
@given(**PACKED)
def test_each_packed_segment_attends_to_its_own_context_like_a_request_alone(
    lens, counts, pads, fill, window, seed
):
    """Fresh prompts, continuing chunks and decode rows in one packed row, each over its own
    block-table row: each segment equals the dense attention of its own request alone, and
    garbage outside every context never reaches an output."""
    args, refs = packed_case(lens, counts[: len(lens)], pads, seed, fill)
    out = block_kv_attention(*args, 0.3, window)
    assert torch.isfinite(out).all()
    start = 0
    for q, k_seq, v_seq, n in refs:
        want = dense_reference(q, k_seq, v_seq, n, 0.3, window)
        torch.testing.assert_close(out[0, start : start + len(q)], want, rtol=1e-5, atol=1e-5)
        start += len(q)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", FAST_PATHS, ids=FAST_IDS)
@settings(max_examples=20, deadline=None)
@given(long=st.booleans(), **PACKED)
def test_the_fast_paths_agree_with_the_golden_on_one_packed_row(
    kernel, long, lens, counts, pads, fill, window, seed
):
    """The same packed rows through each fast path (flex takes every packed row of more than
    ``PAGED_ROWS`` tokens; a long pad tail adds tiles of pads) within float tolerance of the golden."""
    pads += (block_kv_flex.DENSE_ROWS + 1) * long
    args, _ = packed_case(lens, counts[: len(lens)], pads, seed, fill)
    want = block_kv_attention(*args, 0.3, window)
    got = kernel.block_kv_attention(*args, 0.3, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# Half-precision caches through the C++ kernel, against the golden in the same dtype: the kernel
# sums in float32 and rounds once, the golden rounds its probabilities first, so they differ by a
# few units in the last place of the output (bfloat16 keeps 8 bits, float16 11).
HALF = [torch.bfloat16, torch.float16]
HALF_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def in_dtype(args: tuple, dtype: torch.dtype) -> tuple:
    """Kernel args with q, K, V and both caches in ``dtype`` (the step and the rest as they are)."""
    return (*(t.to(dtype) for t in args[:5]), *args[5:])


def assert_half_agrees(args: tuple, window: int | None, dtype: torch.dtype) -> None:
    """The C++ kernel over ``args`` in ``dtype``: finite, in ``dtype``, within its tolerance of the golden."""
    half = in_dtype(args, dtype)
    got = block_kv_cpu.block_kv_attention(*half, 0.3, window)
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = HALF_TOLERANCE[dtype]
    torch.testing.assert_close(got, block_kv_attention(*half, 0.3, window), rtol=tol, atol=tol)


def test_the_cpu_kernel_applies_on_a_cpu_to_one_dtype_it_reads():
    """What picks the kernel (``fast_attention``) and mixed steps (the runtime): one dtype of
    ``DTYPES``, by torch dtype or config name, on a CPU only."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert block_kv_cpu.applies("cpu", dtype, dtype)
        assert block_kv_cpu.applies("cpu", str(dtype).removeprefix("torch."))
        assert not block_kv_cpu.applies("cuda", dtype, dtype)
        assert not block_kv_cpu.applies("xla", dtype)
    assert not block_kv_cpu.applies("cpu", torch.bfloat16, torch.float32)  # q and cache must agree
    assert not block_kv_cpu.applies("cpu", torch.float64)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 30), min_size=1, max_size=3),
    seq=st.integers(1, 6),
    fill=st.sampled_from([float("nan"), 1e30]),
    window=st.sampled_from([None, 1, 4, 20]),
    seed=st.integers(0, 2**16),
)
def test_the_cpu_kernel_reads_half_precision_decode_rows(dtype, lens, seq, fill, window, seed):
    """Decode and speculative rows over bfloat16 and float16 caches, poison in the null block and
    past every context (1e30 is infinite in float16), windows: the golden's output in that dtype."""
    bs = 8
    q, k_act, v_act, k_cache, v_cache, table, _, _ = paged_case(lens, seq, bs, 5, KVH * 3, seed)
    k_cache, v_cache = poisoned(k_cache, v_cache, table, lens, bs, fill)
    step = AttentionStep(remap_null_block_to_sentinel(table), torch.tensor(lens),
                         torch.zeros(len(lens), seq, dtype=torch.int64))
    assert_half_agrees((q, k_act, v_act, k_cache, v_cache, step), window, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["fp32", "bf16", "fp16"])
@settings(max_examples=15, deadline=None)
@given(
    lens=st.lists(st.integers(0, 300), min_size=1, max_size=3),
    seq=st.integers(1, 4),
    bs=st.sampled_from([8, 16, 128]),
    fill=st.sampled_from([float("nan"), 1e30]),
    window=st.sampled_from([None, 5, 70, 200]),
    seed=st.integers(0, 2**16),
)
def test_the_cpu_kernel_folds_long_decode_contexts_a_few_blocks_at_a_time(dtype, lens, seq, bs, fill, window,
                                                                         seed):
    """Decode rows over contexts of many blocks, which the kernel's softmax folds several blocks at
    a time (a partial last fold, windows that start inside a fold, blocks larger than a fold),
    poison past every context: the golden's output."""
    q, k_act, v_act, k_cache, v_cache, table, _, _ = paged_case(lens, seq, bs, -(-300 // bs), KVH * 3, seed)
    k_cache, v_cache = poisoned(k_cache, v_cache, table, lens, bs, fill)
    step = AttentionStep(remap_null_block_to_sentinel(table), torch.tensor(lens),
                         torch.zeros(len(lens), seq, dtype=torch.int64))
    if dtype != torch.float32:
        return assert_half_agrees((q, k_act, v_act, k_cache, v_cache, step), window, dtype)
    args = (q, k_act, v_act, k_cache, v_cache, step, 0.3, window)
    torch.testing.assert_close(block_kv_cpu.block_kv_attention(*args), block_kv_attention(*args))


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.integers(0, 300), min_size=1, max_size=3),
    counts=st.lists(st.integers(1, 200), min_size=3, max_size=3),
    pads=st.integers(0, 40),
    fill=st.sampled_from([float("nan"), 1e30]),
    window=st.sampled_from([None, 1, 17, 100]),
    seed=st.integers(0, 2**16),
)
def test_the_cpu_kernel_reads_half_precision_packed_rows(dtype, lens, counts, pads, fill, window, seed):
    """One packed row in bfloat16 and float16: prompt chunks with context (the GEMM path), decode
    rows riding behind them (the per-key path), pads, windows, poison past every context."""
    args, _ = packed_case(lens, counts[: len(lens)], pads, seed, fill, bs=16, max_blocks=20)
    assert_half_agrees(args, window, dtype)


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.integers(0, 600), min_size=1, max_size=3),
    counts=st.lists(st.integers(1, 300), min_size=3, max_size=3),
    pads=st.integers(0, 40),
    fill=st.sampled_from([float("nan"), 1e30]),
    window=st.sampled_from([None, 1, 17, 100, 400]),
    fused=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_cpu_kernel_takes_prompt_chunks_through_its_gemm_path(lens, counts, pads, fill, window, fused,
                                                                  seed):
    """Prompt chunks longer than the C++ kernel's per-key path: query tiles of stacked heads over
    chunks of keys (the context gathered from its blocks, the chunk's own keys in place), tile and
    chunk edges crossed, windows, poison past every context, and queries and values as views of
    one fused projection beside contiguous keys (as the model passes them, keys rotated); within
    float tolerance of the golden."""
    args, _ = packed_case(lens, counts[: len(lens)], pads, seed, fill, bs=16, max_blocks=40)
    q, k_act, v_act, *rest = args
    if fused:  # (1, T, H + 2 KVH, D) split into views whose tokens are a fused row apart
        q, _, v_act = torch.cat([q, k_act, v_act], dim=2).split([q.shape[2], KVH, KVH], dim=2)
    want = block_kv_attention(q, k_act, v_act, *rest, 0.3, window)
    got = block_kv_cpu.block_kv_attention(q, k_act, v_act, *rest, 0.3, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", [block_kv_torch, block_kv_flex], ids=["golden", "flex"])
@settings(max_examples=20, deadline=None)
@given(long=st.booleans(), **PACKED)
def test_a_fresh_packed_row_over_no_context_columns_equals_it_over_the_whole_table(
    kernel, long, lens, counts, pads, fill, window, seed
):
    """A fresh layer piece's step (nothing cached, a block table of no columns): the same output
    as the full table gives with nothing cached, on short rows (dense) and long ones (flex)."""
    pads += (block_kv_flex.DENSE_ROWS + 1) * long
    args, _ = packed_case([0] * len(lens), counts[: len(lens)], pads, seed, fill)
    q, k_act, v_act, k_cache, v_cache, step = args
    want = block_kv_attention(*args, 0.3, window)
    fresh = step._replace(block_table=step.block_table[:, :0])
    got = kernel.block_kv_attention(q, k_act, v_act, k_cache, v_cache, fresh, 0.3, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
