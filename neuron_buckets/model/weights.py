"""The model's weights in the one form the math takes: a typed record per layer, fused at load.

Projections that read the same input run as one GEMM (gpt-fast's ``wqkv``): q, k and v are one
weight, gate and up another, concatenated along the output features once, when the weights are
loaded, never per call. The eager model and the compiled layer piece read the same ``LayerWeights``;
a compiled graph takes its tensors flat (``tensors()``, in field order, the architecture's absent
ones skipped, a quantized projection as its data then its scale), and ``LayerWeights.of``
rebuilds the record inside the graph. Which checkpoint tensors each field is made of is
``model/checkpoint.py``'s business.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.quant.quantized_weight import QuantizedWeight, runtime_dtype

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the fields a quantized checkpoint quantizes
Weight = Tensor | QuantizedWeight


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. Field order is the compiled layer piece's weight-input order, which
    graphs already compiled into artifacts take: reordering it needs a manifest schema bump."""

    input_norm: Tensor  # (hidden,)
    qkv: Weight  # (H*D + 2*KVH*D, hidden): q, k and v projections stacked
    o: Weight  # (hidden, H*D)
    post_norm: Tensor  # (hidden,)
    gate_up: Weight  # (2*I, hidden): gate and up projections stacked
    down: Weight  # (hidden, I)
    qkv_bias: Tensor | None = None  # (H*D + 2*KVH*D,): qwen2 always, llama/qwen3 with attention_bias
    o_bias: Tensor | None = None  # (hidden,): attention_bias
    q_norm: Tensor | None = None  # (D,): qwen3's RMSNorm over each head of q
    k_norm: Tensor | None = None  # (D,): and of k

    def tensors(self) -> tuple[Tensor, ...]:
        """The fields the architecture has, in order, a quantized one as its data and scale: what a
        compiled layer piece takes."""
        present = (w for w in (getattr(self, f.name) for f in fields(self)) if w is not None)
        return tuple(t for w in present for t in (w.tensors() if isinstance(w, QuantizedWeight) else (w,)))

    def stored(self) -> LayerWeights:
        """The quantized projections as the checkpoint stores them (``QuantizedWeight.stored``)."""
        quantized = {n: w for n in PROJECTIONS if isinstance(w := getattr(self, n), QuantizedWeight)}
        return replace(self, **{n: w.stored() for n, w in quantized.items()})

    @classmethod
    def of(cls, config: LlamaConfig, tensors: Sequence[Tensor]) -> LayerWeights:
        """``tensors()`` back as the record, for a layer of ``config``'s architecture."""
        names, scheme = list(part_shapes(config)), config.quantization
        extra = 0 if scheme is None else 2 if scheme.static_input else 1  # a quantized weight's scales
        if len(tensors) != len(names) + extra * len(PROJECTIONS):
            raise ValueError(f"{len(tensors)} tensors do not make the layer's fields {names}")
        flat, built = iter(tensors), {}
        for name in names:
            if scheme is None or name not in PROJECTIONS:
                built[name] = next(flat)
                continue
            data, scale = next(flat), next(flat)
            built[name] = QuantizedWeight(data, scale, scheme, next(flat) if scheme.static_input else None)
        return cls(**built)


@dataclass(frozen=True)
class ModelWeights:
    """Every weight of the model; built once at load and shared by every graph that runs it."""

    embed: Tensor  # (vocab, hidden)
    layers: tuple[LayerWeights, ...]
    norm: Tensor  # (hidden,)
    lm_head: Tensor | None  # (vocab, hidden); None when tied: the embedding is the output projection

    @property
    def head(self) -> tuple[Tensor, Tensor]:
        """The head piece's weight inputs: final norm and output projection."""
        return self.norm, self.embed if self.lm_head is None else self.lm_head

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor once (a tied embedding once)."""
        yield self.embed
        for layer in self.layers:
            yield from layer.tensors()
        yield self.norm
        if self.lm_head is not None:
            yield self.lm_head


def part_shapes(config: LlamaConfig) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Each ``LayerWeights`` field the architecture has -> the shapes of the parts it stacks along
    dim 0, in stacking order (one part for a field that fuses nothing)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "input_norm": ((c.hidden_size,),),
        "qkv": ((q, c.hidden_size), (kv, c.hidden_size), (kv, c.hidden_size)),
        "o": ((c.hidden_size, q),),
        "post_norm": ((c.hidden_size,),),
        "gate_up": ((c.intermediate_size, c.hidden_size),) * 2,
        "down": ((c.hidden_size, c.intermediate_size),),
    }
    if c.qkv_bias:
        shapes["qkv_bias"] = ((q,), (kv,), (kv,))
    if c.o_bias:
        shapes["o_bias"] = ((c.hidden_size,),)
    if c.qk_norm:
        shapes["q_norm"] = shapes["k_norm"] = ((c.head_dim,),)
    return shapes


def layer_shapes(config: LlamaConfig) -> list[tuple[int, ...]]:
    """Shapes of each field for ``config``: its parts stacked."""
    return [(sum(p[0] for p in parts), *parts[0][1:]) for parts in part_shapes(config).values()]


def example_layer(config: LlamaConfig, dtype: torch.dtype, device: str = "cpu") -> LayerWeights:
    """A layer of zeros, each tensor of the shape and dtype a graph of ``config`` takes at run
    time: what a layer piece is traced with (only shapes and dtypes matter)."""
    scheme, built = config.quantization, {}
    for name, shape in zip(part_shapes(config), layer_shapes(config), strict=True):
        if scheme is not None and name in PROJECTIONS:
            data = torch.zeros(shape, dtype=runtime_dtype(scheme, dtype), device=device)
            input_scale = torch.ones(1, device=device) if scheme.static_input else None
            built[name] = QuantizedWeight(data, torch.zeros(shape[0], device=device), scheme, input_scale)
        else:
            built[name] = torch.zeros(shape, dtype=dtype, device=device)
    return LayerWeights(**built)
