"""A Llama-family decoder over the paged block-KV cache, one forward for every bucket.

gpt-fast style plain PyTorch with the transformers parameter names, so a Hugging Face state dict
loads as is. Llama, Mistral, Qwen2/2.5 and Qwen3 are one decoder with a few switches in the config
(``ARCHITECTURES``): biases on the attention projections, RMSNorm on each head of q and k, and a
sliding attention window. A step runs in three parts that are also the compiled pieces of an artifact:
``embed`` (token ids and positions -> hidden states and rotary angles), ``decoder_layer`` once per
layer (a pure function of its inputs and that layer's weights, so ONE compiled layer serves every
layer), and ``head`` (final norm and LM head on the sampled tokens). Everything is
torch.export-friendly: no data-dependent Python control flow, no ``.item()``, no loop over
tokens; shape checks run only in eager mode. The cache write and the attention go through
``kernels/dispatch.py``: the goldens of ``kernels/block_kv_torch.py`` unless a backend (Neuron)
swaps its own kernels in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neuron_buckets.core.block_table import check_block_ids
from neuron_buckets.kernels.dispatch import block_kv_attention, write_kv_cache

ROPE_TYPES = ("default", "llama3")
# model_type -> the transformers class whose math this file reproduces (tests check each one), and
# what that architecture adds to the Llama decoder.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # attention_bias: biases on q, k, v and o
    "mistral": "MistralForCausalLM",  # sliding_window: every layer sees the last W positions only
    "qwen2": "Qwen2ForCausalLM",  # biases on q, k and v, always (Qwen2 and Qwen2.5)
    "qwen3": "Qwen3ForCausalLM",  # RMSNorm over each head of q and k before RoPE; attention_bias
}
# config.json entries that would change the math; any value but the listed one is refused. Keys an
# architecture's transformers class never reads (Qwen2's attention_bias) are not looked at.
_UNSUPPORTED = {"hidden_act": "silu", "quantization_config": None}
_UNSUPPORTED_BY_TYPE: dict[str, dict[str, object]] = {
    "llama": {"mlp_bias": False, "sliding_window": None, "use_sliding_window": False},
    "mistral": {},
    # Qwen slides only the layers from max_window_layers on, and one compiled layer serves them all.
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False},
}
# Values transformers' config classes assume when config.json leaves a key out.
_DEFAULTS: dict[str, dict[str, object]] = {"mistral": {"sliding_window": 4096}, "qwen3": {"head_dim": 128}}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent rotary scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    model_type: str = "llama"  # a key of ARCHITECTURES
    attention_bias: bool = False  # llama, qwen3: biases on q, k, v and o
    sliding_window: int | None = None  # mistral: a token sees the W positions ending at its own

    def __post_init__(self) -> None:
        check_model_type(self.model_type)
        if self.attention_bias and self.model_type not in ("llama", "qwen3"):
            raise ValueError(f"attention_bias is a llama or qwen3 setting, not {self.model_type}'s")
        if self.sliding_window is not None and (self.model_type != "mistral" or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window} needs model_type mistral and W >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """Read a transformers ``config.json`` dict of an ``ARCHITECTURES`` model, old or new rope
        keys alike; any setting that would change the math and is not modelled here is refused."""
        model_type = check_model_type(hf.get("model_type", "llama"))
        hf = {**_DEFAULTS.get(model_type, {}), **hf}
        for key, allowed in {**_UNSUPPORTED, **_UNSUPPORTED_BY_TYPE[model_type]}.items():
            if hf.get(key, allowed) != allowed:
                raise ValueError(f"config field {key}={hf[key]!r} is not supported (need {allowed!r})")
        if model_type != "mistral" and set(hf.get("layer_types") or ()) - {"full_attention"}:
            raise ValueError(f"config field layer_types={hf['layer_types']!r} is not supported "
                             "(every layer must be full_attention)")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; use one of {ROPE_TYPES}")
        if rope.pop("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported")
        scaling = None
        if rope_type == "llama3":
            try:
                scaling = RopeScaling(**rope)
            except TypeError as e:
                raise ValueError(f"llama3 rope scaling {rope} is invalid: {e}") from None
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            model_type=model_type,
            attention_bias=model_type in ("llama", "qwen3") and hf.get("attention_bias", False),
            sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
        )

    def to_hf(self) -> dict:
        """The ``config.json`` dict (newer ``rope_parameters`` form) that ``from_hf`` reads back, and
        that the architecture's transformers config class reads as the same model."""
        rope: dict = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**rope, **vars(self.rope_scaling), "rope_type": "llama3"}
        own = {
            "llama": {"attention_bias": self.attention_bias},
            "mistral": {"sliding_window": self.sliding_window},
            "qwen3": {"attention_bias": self.attention_bias},
        }
        return {
            "model_type": self.model_type,
            "architectures": [ARCHITECTURES[self.model_type]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            **own.get(self.model_type, {}),
        }


def check_model_type(model_type: str) -> str:
    """The config's model_type if this file reproduces it; named first, before any other field."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; use one of {sorted(ARCHITECTURES)}")
    return model_type


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


class Step(NamedTuple):
    """The step tensors every layer reads (see ``StepInputs`` for their layout)."""

    slot_mapping: Tensor  # (T,)
    block_table: Tensor  # (B, M)
    cache_lens: Tensor  # (B,)
    segment_ids: Tensor  # (T,)


# The weights every layer has, by transformers name (``piece_weight_keys`` fuses some of them).
LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def layer_weight_keys(config: LlamaConfig) -> tuple[str, ...]:
    """One layer's weights by transformers name within the layer: ``LAYER_WEIGHTS``, then the
    biases and q/k norms of the architecture."""
    extra = []
    if config.qkv_bias:
        extra += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if config.o_bias:
        extra.append("self_attn.o_proj.bias")
    if config.qk_norm:
        extra += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return (*LAYER_WEIGHTS, *extra)


# Projections that read the same input, run as one GEMM in a compiled layer: fused name -> parts.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def piece_weight_keys(config: LlamaConfig) -> tuple[str, ...]:
    """What a compiled layer piece takes: ``layer_weight_keys`` with the weights (and biases) of
    each ``FUSED_PROJECTIONS`` group replaced by one tensor, at the place of the group's first part.
    One GEMM with more output columns costs less than several (measured: 8% of a 512-token
    layer's GEMM time on the bench model, 2-core AMD EPYC, 2026-11-30)."""
    keys = []
    for key in layer_weight_keys(config):
        name, kind = key.rsplit(".", 1)
        fused = next((f for f, parts in FUSED_PROJECTIONS.items() if name in parts), None)
        if fused is None:
            keys.append(key)
        elif name == FUSED_PROJECTIONS[fused][0]:
            keys.append(f"{fused}.{kind}")
    return tuple(keys)


def projection_sizes(config: LlamaConfig, fused: str) -> list[int]:
    """Output features of each part of the fused projection ``fused``, in order."""
    c = config
    if fused == "mlp.gate_up_proj":
        return [c.intermediate_size, c.intermediate_size]
    return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]


def fuse_layer_weights(config: LlamaConfig, weights: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
    """One layer's weights by ``layer_weight_keys`` name -> a layer piece's inputs, in
    ``piece_weight_keys`` order (fused groups concatenated along the output features)."""
    out = []
    for key in piece_weight_keys(config):
        name, kind = key.rsplit(".", 1)
        parts = FUSED_PROJECTIONS.get(name)
        out.append(torch.cat([weights[f"{p}.{kind}"] for p in parts]) if parts else weights[key])
    return tuple(out)


def unfused_views(config: LlamaConfig, fused: Sequence[Tensor]) -> dict[str, Tensor]:
    """``fuse_layer_weights``'s output back by ``layer_weight_keys`` name, as views of the fused
    tensors: whoever wants the transformers names shares the one copy in memory."""
    views = {}
    for key, tensor in zip(piece_weight_keys(config), fused, strict=True):
        name, kind = key.rsplit(".", 1)
        if name in FUSED_PROJECTIONS:
            parts = tensor.split(projection_sizes(config, name))
            views.update(zip((f"{p}.{kind}" for p in FUSED_PROJECTIONS[name]), parts, strict=True))
        else:
            views[key] = tensor
    return views


def head_weight_names(config: LlamaConfig) -> list[str]:
    """Final norm and output projection (the embedding itself when tied)."""
    out = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    return ["model.norm.weight", out]


def embed(
    config: LlamaConfig, input_ids: Tensor, positions: Tensor, embed_weight: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states (T, hidden) and rotary cos/sin (T, head_dim) in the model dtype."""
    inv_freq = rope_inv_freq(config, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2), float32 as HF
    angles = torch.cat([freqs, freqs], dim=-1)
    h = F.embedding(input_ids, embed_weight)
    return h, angles.cos().to(h.dtype), angles.sin().to(h.dtype)


def decoder_layer(
    config: LlamaConfig,
    h: Tensor,
    cos: Tensor,
    sin: Tensor,
    step: Step,
    k_cache: Tensor,
    v_cache: Tensor,
    weights: tuple[Tensor, ...],
) -> Tensor:
    """One decoder layer over one layer's (NB, BS, KVH, D) caches, which it updates in place.

    ``weights`` come in ``piece_weight_keys(config)`` order (``fuse_layer_weights``)."""
    c, w = config, dict(zip(piece_weight_keys(config), weights, strict=True))
    tokens, batch = h.shape[0], step.block_table.shape[0]
    seq = tokens // batch
    x = rms_norm(h, w["input_layernorm.weight"], c.rms_norm_eps)
    q, k, v = project(x, w, "self_attn.qkv_proj").split(projection_sizes(c, "self_attn.qkv_proj"), dim=-1)
    q = q.reshape(tokens, c.num_heads, c.head_dim)
    k = k.reshape(tokens, c.num_kv_heads, c.head_dim)
    v = v.reshape(tokens, c.num_kv_heads, c.head_dim)
    if c.qk_norm:  # Qwen3: each head of q and k normalised on its own, before the rotation
        q = rms_norm(q, w["self_attn.q_norm.weight"], c.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], c.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, step.slot_mapping)
    kv_shape = (batch, seq, c.num_kv_heads, c.head_dim)
    out = block_kv_attention(
        q.view(batch, seq, c.num_heads, c.head_dim), k.view(kv_shape), v.view(kv_shape),
        k_cache, v_cache, step.block_table, step.cache_lens, step.segment_ids.view(batch, seq),
        c.head_dim**-0.5, c.sliding_window,
    )
    h = h + project(out.reshape(tokens, c.num_heads * c.head_dim), w, "self_attn.o_proj")
    x = rms_norm(h, w["post_attention_layernorm.weight"], c.rms_norm_eps)
    gate, up = project(x, w, "mlp.gate_up_proj").chunk(2, dim=-1)
    return h + project(F.silu(gate) * up, w, "mlp.down_proj")


def project(x: Tensor, weights: dict[str, Tensor], name: str) -> Tensor:
    """The linear layer ``name`` of a layer's weights, with its bias where the architecture has one."""
    return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))


def head(config: LlamaConfig, h: Tensor, sampling_positions: Tensor, norm: Tensor, out: Tensor) -> Tensor:
    """(N, vocab) float32 logits of the tokens at ``sampling_positions`` only."""
    return F.linear(rms_norm(h[sampling_positions], norm, config.rms_norm_eps), out).float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    """Holds one layer's parameters under their transformers names; ``decoder_layer`` computes."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.config = c

    def weights(self) -> tuple[Tensor, ...]:
        """The layer piece's weight inputs (fused projections concatenated on each call)."""
        return fuse_layer_weights(self.config, dict(self.named_parameters()))


class Backbone(nn.Module):
    """Holds the ``model.*`` parameters, so state-dict names are the transformers ones."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        # Tied: no lm_head parameter at all, the embedding doubles as the output projection.
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of each of the K and V caches: every layer's blocks in one tensor."""
        c = self.config
        return (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def forward(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor,
                block_table: Tensor, cache_lens: Tensor, segment_ids: Tensor,
                sampling_positions: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """One step of B rows x S tokens (T = B * S, row-major) -> (N, vocab) float32 logits.

        Writes the step's K/V into ``k_cache``/``v_cache`` (L, NB, BS, KVH, D) in place through
        ``slot_mapping`` and attends through ``block_table`` (B, M), ``cache_lens`` (B,) and
        ``segment_ids`` (T,); only the tokens at ``sampling_positions`` (N,) reach the final
        norm and the LM head. The same three parts a layer-granular artifact runs as pieces.
        """
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            self.check_step(input_ids, positions, slot_mapping, block_table, cache_lens,
                            segment_ids, sampling_positions, k_cache, v_cache)
        c = self.config
        h, cos, sin = embed(c, input_ids, positions, self.model.embed_tokens.weight)
        step = Step(slot_mapping, block_table, cache_lens, segment_ids)
        for i, layer in enumerate(self.model.layers):
            h = decoder_layer(c, h, cos, sin, step, k_cache[i], v_cache[i], layer.weights())
        params = dict(self.named_parameters())
        return head(c, h, sampling_positions, *(params[n] for n in head_weight_names(c)))

    def check_step(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor,
                   block_table: Tensor, cache_lens: Tensor, segment_ids: Tensor,
                   sampling_positions: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        """Eager-only validation: a wrong step fails here with its bad value, not as garbage."""
        tokens, (batch, max_blocks) = input_ids.shape[0], block_table.shape
        flat = (input_ids.shape, positions.shape, slot_mapping.shape, segment_ids.shape)
        if any(shape != (tokens,) for shape in flat) or tokens % batch or cache_lens.shape != (batch,):
            raise ValueError(f"need T = B * S tokens in 1-D input_ids/positions/slot_mapping/segment_ids "
                             f"and cache_lens (B,) for B={batch} rows, got {flat}, {cache_lens.shape}")
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
