"""Pooling an embedding artifact's hidden states into one vector per input, as vLLM's pooler does.

The graphs return the final norm's output at every position (transformers' ``last_hidden_state``);
``last`` takes each input's last token (the pooling of decoder embedding models such as
Qwen3-Embedding and e5-mistral), ``mean`` averages every token of it. ``normalize`` (the default,
as vLLM's embed pooler) scales each vector to unit L2 norm, so a dot product is a cosine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Pooler:
    pooling: str = "last"  # "last" or "mean"
    normalize: bool = True

    def __call__(self, hidden: Sequence[Tensor]) -> Tensor:
        """(N, hidden) float32: one pooled vector per input's (tokens, hidden) states."""
        lens = torch.tensor([len(h) for h in hidden])
        flat = torch.cat(list(hidden))
        if self.pooling == "last":
            pooled = flat[lens.cumsum(0) - 1]
        else:
            owner = torch.repeat_interleave(torch.arange(len(hidden)), lens)
            sums = flat.new_zeros(len(hidden), flat.shape[1]).index_add_(0, owner, flat)
            pooled = sums / lens[:, None].to(flat.dtype)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled
