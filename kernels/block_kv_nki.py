"""NKI kernels of the two block-KV ops, with the same contract as the goldens of ``block_kv_torch``.

Written against the public NKI 0.3 API (``import nki``; Neuron SDK 2.29 or later). The SDK cannot
be installed where this project is developed and tested, so nothing here has been compiled by the
NKI compiler or run on a NeuronCore; tests run the kernels in ``nki.simulate`` against the goldens
wherever ``nki`` imports, and skip elsewhere. Importing this module never needs the SDK: the kernel
bodies are plain functions, decorated with ``nki.jit`` on first use. ``nki_ops`` wraps them in
the goldens' signatures (the torch glue: layouts, masks, slot ids).
"""

from __future__ import annotations

from functools import cache

try:
    import nki
    import nki.isa as nisa
    import nki.language as nl

    NKI_IMPORT_ERROR = ""
except ImportError as exc:  # no Neuron SDK here: the module stays importable, the kernels not
    nki = nisa = nl = None
    NKI_IMPORT_ERROR = f"cannot import nki ({exc})"

NEG_INF = -1.0e30  # fp32 score of a masked position: exp() of it underflows to exactly 0
PMAX = 128  # SBUF/PSUM partitions, = nl.tile_size.pmax; also the PE transpose/stationary limit
MAX_CTX = 8192  # context positions whose fp32 score row and V tiles fit SBUF (64 KiB/partition)


class NkiUnavailable(RuntimeError):
    """The ``nki`` package (AWS Neuron SDK) is not importable here; the message says what to do."""


def write_kv_cache_kernel(k, v, k_cache, v_cache, slots):
    """Scatter each token's K/V row into the cache at its slot; slot -1 is skipped by the DMA.

    Layout (HBM): ``k``/``v`` (T, KVH, D); ``k_cache``/``v_cache`` (..., BS, KVH, D), one layer
    (NB, BS, KVH, D) or all of them (L, NB, BS, KVH, D), viewed as rows of KVH*D so that a slot
    id is a row index (layer l's slot s is row l*NB*BS + s); ``slots`` (T, 1) int32.
    Tiles: 128 tokens per step, one token per partition, KVH*D elements on the free axis.
    Each tile is one indirect (vector-offset) DMA from SBUF to HBM whose row index is the slot id.
    A -1 row index falls before the cache's first row, and ``oob_mode.skip`` drops that row's
    transfer: a pad token writes nothing at all, it is never redirected onto a real slot.
    Constraints: real slot ids are unique (a scatter; the scheduler guarantees it), KVH*D elements
    of a row fit in one SBUF partition. In place: the kernel returns nothing.
    """
    tokens = k.shape[0]
    kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    width = kv_heads * head_dim
    num_rows = 1
    for size in k_cache.shape[:-2]:
        num_rows = num_rows * size
    k_rows = k_cache.reshape((num_rows, width))
    v_rows = v_cache.reshape((num_rows, width))
    k_src = k.reshape((tokens, width))
    v_src = v.reshape((tokens, width))
    for tile in range((tokens + PMAX - 1) // PMAX):
        start = tile * PMAX
        n = min(PMAX, tokens - start)
        idx = nl.ndarray((n, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=slots[start : start + n, :])
        _scatter_rows(k_rows, k_src[start : start + n, :], idx)
        _scatter_rows(v_rows, v_src[start : start + n, :], idx)


def _scatter_rows(rows, src, idx):
    """rows[idx[p], :] = src[p, :] for every partition p whose idx is inside ``rows``."""
    n, width = src.shape
    tile = nl.ndarray((n, width), dtype=rows.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    dst = rows.ap(pattern=[[width, n], [1, width]], offset=0, vector_offset=idx, indirect_dim=0)
    nisa.dma_copy(dst=dst, src=tile, oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.swdge)


def _gather_rows(dst, rows, idx, column):
    """dst[p, :] = rows[idx[p], column:column + D]; rows with idx outside ``rows`` are skipped."""
    n, width = dst.shape
    src = rows.ap(
        pattern=[[rows.shape[1], n], [1, width]], offset=column, vector_offset=idx, indirect_dim=0
    )
    nisa.dma_copy(dst=dst, src=src, oob_mode=nisa.oob_mode.skip, dge_mode=nisa.dge_mode.swdge)


def _masked_scores(dst, scores, mask, scale):
    """dst = scale * scores where mask, else NEG_INF (a select: garbage never leaks via 0 * x)."""
    rows, cols = dst.shape
    scaled = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=scaled, data=scores, op0=nl.multiply, operand0=scale)
    nisa.memset(dst=dst, value=NEG_INF)
    nisa.tensor_copy_predicated(dst=dst, src=scaled, predicate=mask)


def _transposed(data, dtype):
    """SBUF copy, in ``dtype``, of the PE transpose of an SBUF tile of at most 128 x 128."""
    rows, cols = data.shape
    psum = nl.ndarray((cols, rows), dtype=data.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=psum, data=data)
    out = nl.ndarray((cols, rows), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=psum)
    return out


def block_kv_attention_kernel(
    q, k_active, v_active, k_cache, v_cache, ctx_slots, mask_cache, mask_active, scale
):
    """Block-KV decode attention of one kv-head group per (row, kv head), over cache then step.

    Layout (HBM): ``q`` (B, KVH, R, D) with R = G*S query rows (G = H // KVH query heads of the
    group, row ``j*S + s`` = head j, step token s); ``k_active``/``v_active`` (B, KVH, S, D);
    ``k_cache``/``v_cache`` (NB, BS, KVH, D) viewed as (NB*BS, KVH*D) rows; ``ctx_slots``
    (B, C, 1) int32, the cache slot of context position c (C = M * BS for an M-column block
    table), -1 where nothing must be read (a -1 block-table entry or c >= cache_len);
    ``mask_cache`` (B, KVH, R, C) and ``mask_active`` (B, KVH, R, S) uint8, 1 = attend
    (``mask_cache`` from ``gen_cache_mask``, ``mask_active`` the causal mask of ``gen_active_mask``;
    both narrowed by ``gen_segment_masks`` to segments and to a sliding window, so the kernel needs
    no window of its own: positions outside it are masked scores like any other).
    Output (B, KVH, R, D) in ``q.dtype``.

    Tiles: context tiles of TP = min(C, 128) positions, one position per partition. K and V of a
    tile are gathered by one indirect DMA each with ``oob_mode.skip`` into zeroed SBUF, so -1 slots
    cost no HBM traffic and read as exact zeros (unused blocks, unwritten or stale slots, NaN
    garbage never reach a matmul). Q^T (D x R) is the stationary operand of Q K^T (R x TP per tile,
    fp32 PSUM); scores are scaled and masked by select, softmax runs in fp32 over the R x (C + S)
    score rows in SBUF, and P V accumulates all tiles plus the step's own tokens in one R x D PSUM
    tile. Probabilities are cast to V's dtype before P V, as in the golden.

    Constraints: D <= 128 (contraction on partitions), R = G*S <= 128, S <= 128, C a multiple of
    TP, C <= MAX_CTX. ``nki_ops.attention_kernel_fits`` checks these before the kernel is called.
    """
    batch, kv_heads, rows, head_dim = q.shape
    steps = k_active.shape[2]
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    ctx = ctx_slots.shape[1]
    tp = min(ctx, PMAX)
    tiles = ctx // tp
    assert head_dim <= PMAX, f"head_dim {head_dim} > {PMAX}"
    assert rows <= PMAX, f"query rows per kv head (heads per group * seq) {rows} > {PMAX}"
    assert ctx % tp == 0, f"context length {ctx} is not a multiple of {tp}"
    assert ctx <= MAX_CTX, f"context length {ctx} > {MAX_CTX} does not fit the score rows in SBUF"
    k_rows = k_cache.reshape((num_blocks * block_size, kv_heads * head_dim))
    v_rows = v_cache.reshape((num_blocks * block_size, kv_heads * head_dim))
    out = nl.ndarray((batch, kv_heads, rows, head_dim), dtype=q.dtype, buffer=nl.shared_hbm)

    for b in nl.affine_range(batch):
        for g in nl.affine_range(kv_heads):
            q_sb = nl.ndarray((rows, head_dim), dtype=q.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=q_sb, src=q[b, g])
            q_t = _transposed(q_sb, q.dtype)  # (D, R): stationary of Q K^T
            scores = nl.ndarray((rows, ctx + steps), dtype=nl.float32, buffer=nl.sbuf)
            v_ctx = nl.ndarray((tp, tiles, head_dim), dtype=v_cache.dtype, buffer=nl.sbuf)

            for t in range(tiles):
                cols = slice(t * tp, (t + 1) * tp)
                idx = nl.ndarray((tp, 1), dtype=nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=idx, src=ctx_slots[b, cols, :])
                k_sb = nl.ndarray((tp, head_dim), dtype=k_cache.dtype, buffer=nl.sbuf)
                nisa.memset(dst=k_sb, value=0.0)
                _gather_rows(k_sb, k_rows, idx, g * head_dim)
                nisa.memset(dst=v_ctx[:, t, :], value=0.0)
                _gather_rows(v_ctx[:, t, :], v_rows, idx, g * head_dim)
                qk = nl.ndarray((rows, tp), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=qk, stationary=q_t, moving=_transposed(k_sb, q.dtype))
                mask = nl.ndarray((rows, tp), dtype=nl.uint8, buffer=nl.sbuf)
                nisa.dma_copy(dst=mask, src=mask_cache[b, g, :, cols])
                _masked_scores(scores[:, cols], qk, mask, scale)

            k_act = nl.ndarray((steps, head_dim), dtype=k_active.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=k_act, src=k_active[b, g])
            qk_act = nl.ndarray((rows, steps), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=qk_act, stationary=q_t, moving=_transposed(k_act, q.dtype))
            mask_act = nl.ndarray((rows, steps), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.dma_copy(dst=mask_act, src=mask_active[b, g])
            _masked_scores(scores[:, ctx : ctx + steps], qk_act, mask_act, scale)

            _softmax_rows(scores)  # every row sees its own step token, so never all-masked
            pv = nl.ndarray((rows, head_dim), dtype=nl.float32, buffer=nl.psum)
            for t in range(tiles):  # first matmul into pv overwrites, the rest accumulate
                p_t = _transposed(scores[:, t * tp : (t + 1) * tp], v_cache.dtype)
                nisa.nc_matmul(dst=pv, stationary=p_t, moving=v_ctx[:, t, :])
            v_act = nl.ndarray((steps, head_dim), dtype=v_active.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=v_act, src=v_active[b, g])
            p_act = _transposed(scores[:, ctx : ctx + steps], v_active.dtype)
            nisa.nc_matmul(dst=pv, stationary=p_act, moving=v_act)

            o_sb = nl.ndarray((rows, head_dim), dtype=q.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o_sb, src=pv)
            nisa.dma_copy(dst=out[b, g], src=o_sb)
    return out


def _softmax_rows(scores):
    """Row softmax of an fp32 SBUF tile along the free axis, in place (one score buffer only)."""
    rows = scores.shape[0]
    row_max = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=row_max, op=nl.maximum, data=scores, axis=(1,))
    nisa.tensor_scalar(dst=scores, data=scores, op0=nl.subtract, operand0=row_max)
    nisa.activation(dst=scores, op=nl.exp, data=scores)
    total = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=total, op=nl.add, data=scores, axis=(1,))
    inv = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=total)
    nisa.tensor_scalar(dst=scores, data=scores, op0=nl.multiply, operand0=inv)


@cache
def jitted() -> tuple:
    """The two kernels wrapped by ``nki.jit`` (framework detected from the arguments)."""
    if nki is None:
        raise NkiUnavailable(
            f"{NKI_IMPORT_ERROR}; the NKI kernels need the AWS Neuron SDK 2.29+ (nki 0.3): "
            "pip install torch-neuronx neuronx-cc nki "
            "--extra-index-url https://pip.repos.neuron.amazonaws.com"
        )
    return nki.jit(write_kv_cache_kernel), nki.jit(block_kv_attention_kernel)
