"""``QuantizedWeight``: one projection's quantized weight, a ``LayerWeights`` field like a tensor.

It is two graph inputs, ``data`` and ``scale`` (``LayerWeights.tensors()`` flattens it, ``of``
rebuilds it with the config's scheme), so one compiled layer piece serves every layer's weights.
The scale is per output channel, float32, (out,): parts fused along dim 0 (q, k and v) each keep
their own scale that way, a checkpoint's per-tensor scale included. A scheme with static
activations adds a third, ``input_scale`` (float32, (1,), as compressed-tensors stores it:
torch-xla would fold a 0-d input of 0 or 1 into a constant): the parts fused read the same input,
so they share one, the largest of theirs, as vLLM fuses them (a calibration over their common
input gives them the same). ``linear`` is the one place that computes with it
(``model/linear.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from neuron_buckets.model.quant.quant_scheme import QuantScheme


def runtime_dtype(scheme: QuantScheme, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a projection's data when a graph runs: int8 as stored; float8 widened to the
    model dtype as the runtime loads it (exact: every e4m3 value is a bfloat16 and a float16),
    because no CPU GEMM here reads float8 at speed (``model/linear.py``)."""
    return torch.int8 if scheme.weights == "int8" else model_dtype


@dataclass(frozen=True)
class QuantizedWeight:
    """``data`` (out, in) as the scheme stores it (or a kernel's packed layout of it) times
    ``scale`` (out,), or () for one scale over the whole tensor."""

    data: Tensor
    scale: Tensor
    scheme: QuantScheme
    input_scale: Tensor | None = None  # the activations' static scale (``scheme.static_input``)
    vnni: bool = False  # ``data`` in the layout of nb's INT8 kernel (``kernels/int8_linear_cpu.py``)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.data, self.scale) + (() if self.input_scale is None else (self.input_scale,))

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0: output channels, with their scales) or columns (dim 1: input features,
        which every channel's scale covers) of the weight."""
        per_channel = dim == 0 and self.scale.dim() == 1
        scale = self.scale.narrow(0, start, length) if per_channel else self.scale
        return replace(self, data=self.data.narrow(dim, start, length), scale=scale)

    def stored(self) -> QuantizedWeight:
        """The data in the dtype the checkpoint stores (float8 as float8, not widened): what a
        graph takes on a device that converts it in the graph (the Neuron pieces, as NxD does)."""
        return replace(self, data=self.data.to(getattr(torch, self.scheme.weights)))

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """The dense weight this stands for, computed in float32 and rounded once to ``dtype``."""
        scale = self.scale[:, None] if self.scale.dim() == 1 else self.scale
        return (self.data.float() * scale).to(dtype)

    def split(self, sizes: Sequence[int]) -> list[QuantizedWeight]:
        """Parts of ``sizes`` output channels each (views), as the checkpoint stored them."""
        scales = self.scale.split(list(sizes)) if self.scale.dim() == 1 else [self.scale] * len(sizes)
        datas = self.data.split(list(sizes))
        return [replace(self, data=d, scale=s) for d, s in zip(datas, scales, strict=True)]

    @classmethod
    def fuse(cls, parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Parts stacked along the output channels, each channel with its part's scale."""
        if len(parts) == 1:
            return parts[0]
        scales = [p.scale.expand(p.data.shape[0]) for p in parts]
        inputs = [p.input_scale for p in parts if p.input_scale is not None]
        input_scale = torch.cat(inputs).amax().reshape(1) if inputs else None
        return cls(torch.cat([p.data for p in parts]), torch.cat(scales), parts[0].scheme, input_scale)
