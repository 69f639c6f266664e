"""Multi-LoRA in fixed slots: the layer piece with adapter slots as inputs (vLLM Neuron's design).

Each targeted projection takes ``A[slots, in, r]`` and ``B[slots, r, out]``, ``slots`` being
``max_loras + 1``: slot 0 holds zeros, which is the base model. A per-token slot index (T,) picks
each token's adapter, so one call mixes base rows and rows of several adapters. The slots are
graph inputs like the weights, never constants: loading an adapter fills a slot, no graph
changes. PEFT's scaling (``lora_alpha / r``) is folded into B when an adapter is loaded, and a
rank below ``max_rank`` is padded with zeros.

The math runs as two dense products per projection, with no per-token gather of matrices:
``x @ A`` for every slot at once (T, slots, r), the slots a token does not use masked to zero,
then one product with every slot's B stacked along the rank. Its extra work per token is
``slots * r * (in + out)``, small beside the base projection's ``in * out`` for a few slots of a
small rank. ``adapt`` turns a layer piece into the LoRA one when an artifact is built or loaded,
so the layer code itself has no LoRA branch: the adapted projections are ``AdaptedWeight``s that
``model/linear.py`` adds the delta of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from neuron_buckets.kernels.attention_step import AttentionStep
from neuron_buckets.model.lora_weight import AdaptedWeight
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.pieces import LayerPiece
from neuron_buckets.model.weights import LayerWeights

# PEFT's module name of each projection -> the fused ``LayerWeights`` field and its part there.
PARTS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}


def projection_dims(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features, as PEFT's A and B see them."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    hidden, inter = c.hidden_size, c.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class LoraShape:
    """What a LoRA layer piece's inputs look like: its slots, rank and targeted projections."""

    max_loras: int
    max_rank: int
    targets: tuple[str, ...]  # PEFT's names, in the layer's order

    @property
    def slots(self) -> int:
        return self.max_loras + 1

    def slot_shapes(self, config: LlamaConfig) -> list[tuple[int, ...]]:
        """A then B of each target, in order: what a layer's slot tensors are."""
        dims = projection_dims(config)
        return [s for t in self.targets
                for s in ((self.slots, dims[t][0], self.max_rank), (self.slots, self.max_rank, dims[t][1]))]

    @classmethod
    def of(cls, max_loras: int, max_rank: int, targets: Sequence[str]) -> LoraShape | None:
        """The shape of a config's ``[lora]`` or a manifest's ``lora``; None when it has no slots."""
        return cls(max_loras, max_rank, tuple(targets)) if max_loras else None

    def zeros(self, config: LlamaConfig, dtype: torch.dtype, device: str = "cpu") -> tuple[Tensor, ...]:
        """A layer's slot tensors, every slot empty (the base model)."""
        return tuple(torch.zeros(s, dtype=dtype, device=device) for s in self.slot_shapes(config))


def adapted_layer(config: LlamaConfig, layer: LayerWeights, shape: LoraShape, token_slots: Tensor,
                  slot_tensors: Sequence[Tensor]) -> LayerWeights:
    """``layer`` with each targeted projection's slots attached (``slot_tensors``: A, B per target)."""
    given = dict(zip(shape.targets, zip(slot_tensors[0::2], slot_tensors[1::2], strict=True), strict=True))
    dims = projection_dims(config)
    fields: dict[str, list[tuple[Tensor, Tensor] | int]] = {}
    for name, (field, _) in PARTS.items():
        fields.setdefault(field, []).append(given.get(name, dims[name][1]))
    return replace(layer, **{
        field: AdaptedWeight(getattr(layer, field), tuple(parts), token_slots)
        for field, parts in fields.items() if any(not isinstance(p, int) for p in parts)
    })


class LoraLayerPiece(LayerPiece):
    """The layer piece with two more inputs: each token's slot and the layer's slot tensors."""

    def __init__(self, piece: LayerPiece, shape: LoraShape) -> None:
        super().__init__(piece.config, piece.tp)
        self.lora = shape

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, block_table: Tensor,  # type: ignore[override]
                cache_lens: Tensor, segment_ids: Tensor, k_cache: Tensor, v_cache: Tensor,
                weights: tuple[Tensor, ...], token_slots: Tensor, slot_tensors: tuple[Tensor, ...]) -> Tensor:
        base = LayerWeights.of(self.config, weights)
        layer = adapted_layer(self.config, base, self.lora, token_slots, slot_tensors)
        step = AttentionStep(block_table, cache_lens, segment_ids)
        return self.run(h, cos, sin, slot_mapping, step, k_cache, v_cache, layer)


def adapt(piece: nn.Module, shape: LoraShape | None) -> nn.Module:
    """The piece as a LoRA artifact runs it: a layer piece takes slots, any other is unchanged."""
    if shape is None or not isinstance(piece, LayerPiece):
        return piece
    return LoraLayerPiece(piece, shape)


def example_lora_inputs(shape: LoraShape, config: LlamaConfig, tokens: int, dtype: torch.dtype,
                        device: str = "cpu") -> tuple[Tensor, tuple[Tensor, ...]]:
    """A LoRA layer piece's extra inputs to trace it with: token slots and empty slot tensors."""
    return torch.zeros(tokens, dtype=torch.int64, device=device), shape.zeros(config, dtype, device)
