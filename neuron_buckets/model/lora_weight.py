"""A projection with LoRA slots attached, as ``model/linear.py`` computes it (``model/lora.py``
attaches them): the base projection plus each token's adapter's ``x @ A @ B``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from neuron_buckets.model.weights import Weight


@dataclass(frozen=True)
class AdaptedWeight:
    """A fused projection with its parts' LoRA slots: ``linear`` computes the base projection and
    adds ``delta``. ``parts`` has (A, B) for a targeted part, its output width for another."""

    base: Weight
    parts: tuple[tuple[Tensor, Tensor] | int, ...]
    token_slots: Tensor  # (T,) each token's slot

    def delta(self, x: Tensor) -> Tensor:
        """(T, out): each token's adapter's ``x @ A @ B`` for every part, zeros where untargeted."""
        slots = self.token_slots.shape[0]
        out = []
        for part in self.parts:
            if isinstance(part, int):
                out.append(x.new_zeros(slots, part))
                continue
            a, b = part
            mask = (self.token_slots[:, None] == torch.arange(a.shape[0], device=x.device)).to(x.dtype)
            xa = torch.einsum("ti,sir->tsr", x, a) * mask[:, :, None]
            out.append(torch.einsum("tsr,sro->to", xa, b))
        return out[0] if len(out) == 1 else torch.cat(out, dim=-1)
