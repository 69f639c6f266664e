"""The torch side of the NKI attention kernel's call, the one part of the NKI path that runs without
the Neuron SDK: each Neuron route's tests lower it and run it against eager."""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_buckets.model.tp.tensor_parallel import SINGLE


class KernelGlue(torch.nn.Module):
    """The torch side of the NKI attention kernel's call (layouts, masks, slot ids), which the
    Neuron layer graph traces around the kernel; one rank's, as every piece."""

    tp = SINGLE

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, table: Tensor, lens: Tensor, segments: Tensor
    ) -> tuple[Tensor, ...]:
        from neuron_buckets.kernels import nki_ops
        from neuron_buckets.kernels.attention_step import AttentionStep

        return nki_ops.attention_kernel_inputs(q, k, v, AttentionStep(table, lens, segments), 8)


def glue_args() -> tuple[Tensor, ...]:
    """Two rows of three positions: four query heads, two KV heads, blocks of 8, one row's table
    with two blocks and the other's with one."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, heads, 16, generator=gen) for heads in (4, 2, 2))
    table = torch.tensor([[3, 4, -1] + [-1] * 13, [5] + [-1] * 15])
    lens, segments = torch.tensor([13, 2]), torch.zeros(2, 3, dtype=torch.int64)
    return q, k, v, table, lens, segments
