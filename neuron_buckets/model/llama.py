"""A Llama-family decoder over the paged block-KV cache, one forward for every bucket.

gpt-fast style plain PyTorch over the fused weights of ``model/weights.py``; the config's switches
(``model/model_config.py``) cover Llama, Mistral, Qwen2/2.5 and Qwen3. A step runs in three parts
that are also the compiled pieces of an artifact: ``embed`` (token ids and positions -> hidden
states and rotary angles), ``decoder_layer`` once per layer (a pure function of its inputs and
that layer's weights, so ONE compiled layer serves every layer), and ``head`` (final norm and LM
head on the sampled tokens). Everything is torch.export-friendly: no data-dependent Python control
flow, no ``.item()``, no loop over tokens; shape checks run only in eager mode. The cache write
and the attention go through ``kernels/dispatch.py``: the torch kernels unless a backend (Neuron)
swaps its own in; the projections go through ``model/linear.py`` (oneDNN in inductor's CPU graphs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neuron_buckets.core.block_table import check_block_ids
from neuron_buckets.kernels.attention_step import AttentionStep
from neuron_buckets.kernels.dispatch import block_kv_attention, write_kv_cache
from neuron_buckets.model.linear import linear
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.tp.tensor_parallel import SINGLE, TensorParallel
from neuron_buckets.model.weights import LayerWeights, ModelWeights


def rope_inv_freq(config: LlamaConfig, device: torch.device | str = "cpu") -> Tensor:
    """Rotary inverse frequencies, with Llama 3's low-frequency stretch when configured.

    Always float32 and computed in the graph, never a buffer that ``model.to(bf16)`` would round.
    """
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (T, heads, D) by per-token angles, halves convention (as HF checkpoints expect)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def embed(
    config: LlamaConfig, input_ids: Tensor, positions: Tensor, embed_weight: Tensor,
    tp: TensorParallel = SINGLE,
) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states (T, hidden) and rotary cos/sin (T, head_dim) in the model dtype.

    Tensor-parallel: ``embed_weight`` is the rank's vocabulary rows and ``input_ids`` are relative
    to its first row; a token outside them embeds as zeros here and is summed in from its rank."""
    inv_freq = rope_inv_freq(config, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2), float32 as HF
    angles = torch.cat([freqs, freqs], dim=-1)
    if tp.size == 1:
        h = F.embedding(input_ids, embed_weight)
    else:
        rows = embed_weight.shape[0]
        mine = (input_ids >= 0) & (input_ids < rows)
        h = tp.all_reduce(F.embedding(input_ids.clamp(0, rows - 1), embed_weight) * mine[:, None])
    return h, angles.cos().to(h.dtype), angles.sin().to(h.dtype)


def decoder_layer(
    config: LlamaConfig,
    h: Tensor,
    cos: Tensor,
    sin: Tensor,
    slot_mapping: Tensor,
    step: AttentionStep,
    k_cache: Tensor,
    v_cache: Tensor,
    w: LayerWeights,
    tp: TensorParallel = SINGLE,
) -> Tensor:
    """One decoder layer over one layer's (NB, BS, KVH, D) caches, which it updates in place: the
    step's K/V go to ``slot_mapping`` (T,), its B rows of S tokens attend as ``step`` says.

    Tensor-parallel: ``config`` has the rank's heads and MLP features (``TensorParallel.local``);
    the o and down projections give partial sums, all-reduced before the residual adds them."""
    c = config
    tokens, (batch, seq) = h.shape[0], step.segment_ids.shape
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    x = rms_norm(h, w.input_norm, c.rms_norm_eps)
    q, k, v = linear(x, w.qkv, w.qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(tokens, c.num_heads, c.head_dim)
    k = k.reshape(tokens, c.num_kv_heads, c.head_dim)
    v = v.reshape(tokens, c.num_kv_heads, c.head_dim)
    if w.q_norm is not None:  # Qwen3: each head of q and k normalised on its own, before the rotation
        q = rms_norm(q, w.q_norm, c.rms_norm_eps)
        k = rms_norm(k, w.k_norm, c.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    kv_shape = (batch, seq, c.num_kv_heads, c.head_dim)
    out = block_kv_attention(
        q.view(batch, seq, c.num_heads, c.head_dim), k.view(kv_shape), v.view(kv_shape),
        k_cache, v_cache, step, c.head_dim**-0.5, c.sliding_window,
    )
    if tp.size == 1:
        h = h + linear(out.reshape(tokens, q_size), w.o, w.o_bias)
    else:  # the bias once, after the sum
        attn = tp.all_reduce(linear(out.reshape(tokens, q_size), w.o))
        h = h + (attn if w.o_bias is None else attn + w.o_bias)
    x = rms_norm(h, w.post_norm, c.rms_norm_eps)
    gate, up = linear(x, w.gate_up).chunk(2, dim=-1)
    return h + tp.all_reduce(linear(F.silu(gate) * up, w.down))


def head(config: LlamaConfig, h: Tensor, sampling_positions: Tensor, norm: Tensor, out: Tensor,
         tp: TensorParallel = SINGLE) -> Tensor:
    """(N, vocab) float32 logits of the tokens at ``sampling_positions`` only; tensor-parallel,
    every rank's vocabulary rows gathered, (N, size * vocab_rows), padding rows last."""
    return tp.all_gather(linear(rms_norm(h[sampling_positions], norm, config.rms_norm_eps), out).float())


class Llama(nn.Module):
    """The whole model eagerly (the reference ``nb verify`` checks compiled pieces against).

    It holds no parameters: ``weights`` is the record built at load (``model/checkpoint.py``),
    which a runtime may share with its compiled graphs.
    """

    def __init__(self, config: LlamaConfig, weights: ModelWeights) -> None:
        super().__init__()
        self.config, self.weights = config, weights

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of each of the K and V caches: every layer's blocks in one tensor."""
        c = self.config
        return (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def forward(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor,
                block_table: Tensor, cache_lens: Tensor, segment_ids: Tensor,
                sampling_positions: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """One step of B rows x S tokens (T = B * S, row-major) -> (N, vocab) float32 logits.

        Writes the step's K/V into ``k_cache``/``v_cache`` (L, NB, BS, KVH, D) in place through
        ``slot_mapping`` and attends through ``block_table`` (R, M), ``cache_lens`` (R,) and
        ``segment_ids`` (B, S): decode rows (B = R) or one packed row (B = 1); only the tokens at
        ``sampling_positions`` (N,) reach the final
        norm and the LM head. The same three parts a layer-granular artifact runs as pieces.
        """
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            self.check_step(input_ids, positions, slot_mapping, block_table, cache_lens,
                            segment_ids, sampling_positions, k_cache, v_cache)
        c, w = self.config, self.weights
        h, cos, sin = embed(c, input_ids, positions, w.embed)
        step = AttentionStep(block_table, cache_lens, segment_ids)
        for i, layer in enumerate(w.layers):
            h = decoder_layer(c, h, cos, sin, slot_mapping, step, k_cache[i], v_cache[i], layer)
        return head(c, h, sampling_positions, *w.head)

    def check_step(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor,
                   block_table: Tensor, cache_lens: Tensor, segment_ids: Tensor,
                   sampling_positions: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        """Eager-only validation: a wrong step fails here with its bad value, not as garbage."""
        tokens, (rows, max_blocks) = input_ids.shape[0], block_table.shape
        flat = (input_ids.shape, positions.shape, slot_mapping.shape)
        if any(shape != (tokens,) for shape in flat) or cache_lens.shape != (rows,):
            raise ValueError(f"need T tokens in 1-D input_ids/positions/slot_mapping and cache_lens (R,) "
                             f"for R={rows} block-table rows, got {flat}, {tuple(cache_lens.shape)}")
        if segment_ids.dim() != 2 or segment_ids.numel() != tokens or segment_ids.shape[0] not in (1, rows):
            raise ValueError(f"segment_ids must be (B, S) with B * S = {tokens} tokens and B = {rows} "
                             f"(decode rows) or 1 (one packed row), got {tuple(segment_ids.shape)}")
        if k_cache.dim() != 5 or k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                             "must be equal 5-D (layers, blocks, block_size, kv_heads, head_dim)")
        num_blocks, block_size = k_cache.shape[1:3]
        if k_cache.shape != self.cache_shape(num_blocks, block_size):
            raise ValueError(f"cache geometry {tuple(k_cache.shape)} does not match the model, "
                             f"expected {self.cache_shape(num_blocks, block_size)}")
        check_block_ids(block_table, num_blocks)
        ctx = max_blocks * block_size
        if int(cache_lens.max()) > ctx:
            raise ValueError(f"row context {int(cache_lens.max())} exceeds the bucket's ctx {ctx} "
                             f"({max_blocks} blocks of {block_size}); use a larger bucket")
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is beyond max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        if bool(((sampling_positions < 0) | (sampling_positions >= tokens)).any()):
            raise ValueError(f"sampling_positions must lie in [0, {tokens})")
