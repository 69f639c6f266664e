"""The runtime's LoRA slots: every layer's stacked A/B tensors, and each call's token slots.

Slot 0 stays zeros (the base model); ``fill`` copies an adapter into another slot in place, so
the tensors the layer pieces take never move and no graph changes. A call's token slots come
from the slot of each of its segments (``Segment.lora_slot``): a decode row's tokens take their
row's, a packed call's tokens their segment's, padding slot 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from neuron_buckets.artifact.manifest import Manifest
from neuron_buckets.core.padding import PaddedCall
from neuron_buckets.model.lora import LoraShape
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.runtime.lora_adapter import LoraAdapter


class LoraSlots:
    def __init__(self, shape: LoraShape, config: LlamaConfig, dtype: torch.dtype, device: str) -> None:
        self.shape = shape
        self.layers = [shape.zeros(config, dtype, device) for _ in range(config.num_layers)]

    def fill(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (1 to max_loras), zeros for the targets it lacks."""
        if not 0 < slot <= self.shape.max_loras:
            raise ValueError(f"slot {slot} is not one of the artifact's 1..{self.shape.max_loras}")
        for tensors, given in zip(self.layers, adapter.layers, strict=True):
            for i, target in enumerate(self.shape.targets):
                a, b = tensors[2 * i], tensors[2 * i + 1]
                pair = given.get(target)
                a[slot] = 0 if pair is None else pair[0]
                b[slot] = 0 if pair is None else pair[1]

    def token_slots(self, step: PaddedCall, segment_slots: Sequence[int]) -> Tensor:
        """(T,) each token's slot: a decode row's (row ``r`` is segment ``r``) or a packed
        segment's; padding rows and tokens slot 0."""
        rows, _ = step.segment_ids.shape
        owner = (step.segment_ids + torch.arange(rows)[:, None]).reshape(-1)
        size = max(rows, len(segment_slots)) + int(step.segment_ids.max()) + 1
        table = torch.zeros(size, dtype=torch.int64)
        table[: len(segment_slots)] = torch.as_tensor(list(segment_slots), dtype=torch.int64)
        return table[owner]

    def inputs(self, step: PaddedCall, segment_slots: Sequence[int], device: str) -> list[tuple]:
        """Each layer's extra inputs for one call: its token slots and that layer's slot tensors."""
        slots = self.token_slots(step, segment_slots).to(device)
        return [(slots, tensors) for tensors in self.layers]


def open_slots(manifest: Manifest, config: LlamaConfig, device: str) -> LoraSlots | None:
    """The slots of a LoRA artifact, all empty; None for one without."""
    lo = manifest.lora
    shape = lo and LoraShape.of(lo.max_loras, lo.max_lora_rank, lo.target_modules)
    return shape and LoraSlots(shape, config, getattr(torch, manifest.cache.dtype), device)
