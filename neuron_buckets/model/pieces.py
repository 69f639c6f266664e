"""The compiled pieces of a bucket: embed, one decoder layer, head.

A bucket's step is ``embed`` once, the layer piece once per layer (each call with that layer's
weights and its slice of the stacked KV cache), then ``head``. The layer is compiled once per
bucket shape whatever the depth, so compile time does not grow with the number of layers.
Weights are graph inputs, never constants: one compiled layer serves every layer, and the
runtime's one weights copy feeds them all. Tensor-parallel pieces are built at one rank's shapes
(``config`` is ``TensorParallel.local``'s) and serve every rank. ``embed`` and ``head`` depend
only on the token and sample counts; on backends with dynamic shapes each is compiled once for
every bucket (its ``PieceShape`` has ``tokens == 0``), elsewhere once per count, shared by
buckets of that count.

A packed prefill bucket may have a second layer piece, its ``fresh_layer``: the same layer over
no context (``ctx`` 0), which the runtime runs when no segment of a call has anything cached.
The context piece keeps key buffers for every segment's whole block-table row (``max_num_seqs``
times ``max_model_len`` positions), and building them cost more than the attention itself on a
fresh 512-token call; the fresh piece has only the step's own keys.

An embedding artifact's buckets end in ``norm`` instead of ``head``: the final norm over every
position of the step, (T, hidden) float32 hidden states for the host to pool. It needs no sample
positions (pooling may read every token), so it depends on the token count alone, like ``embed``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn
from torch.export import Dim

from neuron_buckets.core.bucket import Bucket
from neuron_buckets.kernels.attention_step import AttentionStep
from neuron_buckets.model.llama import decoder_layer, embed, head, rms_norm
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.tp.tensor_parallel import SINGLE, TensorParallel
from neuron_buckets.model.weights import LayerWeights, example_layer

Role = Literal["embed", "layer", "head", "norm"]
ROLES: tuple[Role, ...] = ("embed", "layer", "head", "norm")
# What a piece is to its bucket: one of the roles, or the fresh layer (a "layer" piece over ctx 0).
BucketRole = Literal["embed", "layer", "fresh_layer", "head", "norm"]


@dataclass(frozen=True, order=True)
class PieceShape:
    """What a piece's graph depends on: its role and the step dimensions it sees."""

    role: Role
    tokens: int  # T, the step's token positions; 0: any (a dynamic-shape embed or head)
    rows: int = 0  # layer: block-table rows B
    ctx: int = 0  # layer: context positions (a block multiple)
    samples: int = 0  # head: sampled tokens N
    packed: bool = False  # layer: one step row of segments over the rows (else a step row each)

    @property
    def dynamic(self) -> bool:
        return self.tokens == 0

    @property
    def name(self) -> str:
        if self.dynamic:
            return self.role
        t = f"t{self.tokens}"
        dims = {"embed": t, "head": f"{t}_n{self.samples}", "norm": t}
        layer = f"t{self.tokens}_b{self.rows}_c{self.ctx}" + ("_packed" if self.packed else "")
        return f"{self.role}_" + dims.get(self.role, layer)


def bucket_pieces(bucket: Bucket, dynamic: bool, decode_seq: int = 1, fresh: bool = False,
                  embedding: bool = False) -> dict[BucketRole, PieceShape]:
    """The pieces of a bucket. Every segment of a step has its own block-table row (a decode row
    per request, a packed segment per chunk or decode row); ``Bucket.samples`` says how many
    logits come back, ``decode_seq`` being the decode rows' width. With ``dynamic``, embed and
    head are the one shape-polymorphic piece every bucket shares; with ``fresh``, a packed
    bucket also has its ``fresh_layer``; with ``embedding``, ``norm`` replaces ``head``."""
    tokens, packed = bucket.tokens, bucket.kind == "prefill"
    layer = PieceShape("layer", tokens, rows=bucket.batch, ctx=bucket.ctx, packed=packed)
    pieces: dict[BucketRole, PieceShape] = (
        {"embed": PieceShape("embed", 0), "layer": layer, "head": PieceShape("head", 0)} if dynamic else
        {"embed": PieceShape("embed", tokens), "layer": layer,
         "head": PieceShape("head", tokens, samples=bucket.samples(decode_seq))}
    )
    if fresh and packed:
        pieces["fresh_layer"] = replace(layer, ctx=0)
    if embedding:
        del pieces["head"]
        pieces["norm"] = PieceShape("norm", 0 if dynamic else tokens)
    return pieces


class EmbedPiece(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = config, tp

    def forward(self, input_ids: Tensor, positions: Tensor, embed_weight: Tensor) -> tuple[Tensor, ...]:
        return embed(self.config, input_ids, positions, embed_weight, self.tp)


class LayerPiece(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = config, tp

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, block_table: Tensor,
                cache_lens: Tensor, segment_ids: Tensor, k_cache: Tensor, v_cache: Tensor,
                weights: tuple[Tensor, ...]) -> Tensor:
        """``weights``: the layer's ``LayerWeights.tensors()``, flat as a compiled graph takes them."""
        step = AttentionStep(block_table, cache_lens, segment_ids)
        layer = LayerWeights.of(self.config, weights)
        return self.run(h, cos, sin, slot_mapping, step, k_cache, v_cache, layer)

    def run(self, h: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, step: AttentionStep,
            k_cache: Tensor, v_cache: Tensor, layer: LayerWeights) -> Tensor:
        """The layer over its weights as a record, which a transform of the piece may have changed."""
        return decoder_layer(self.config, h, cos, sin, slot_mapping, step, k_cache, v_cache, layer, self.tp)


class HeadPiece(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = config, tp

    def forward(self, h: Tensor, sampling_positions: Tensor, norm: Tensor, out: Tensor) -> Tensor:
        return head(self.config, h, sampling_positions, norm, out, self.tp)


class NormPiece(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = config, tp

    def forward(self, h: Tensor, norm: Tensor) -> Tensor:
        """The final norm's (T, hidden) float32 output at every position: the hidden states that
        transformers returns as ``last_hidden_state``."""
        return rms_norm(h, norm, self.config.rms_norm_eps).float()


# Counts a dynamic piece is traced with (above 1, so that export does not specialise on them).
EXAMPLE_TOKENS, EXAMPLE_SAMPLES, MAX_DYNAMIC = 8, 4, 1 << 20

PIECES: dict[Role, type[nn.Module]] = {
    "embed": EmbedPiece, "layer": LayerPiece, "head": HeadPiece, "norm": NormPiece
}


def build_piece(name: str, config: LlamaConfig, tp: TensorParallel = SINGLE) -> nn.Module:
    """The piece of role (or class name) ``name`` for the model ``config``, at one rank's shapes."""
    cls = PIECES.get(name) or {c.__name__: c for c in PIECES.values()}[name]  # type: ignore[call-overload]
    return cls(tp.local(config), tp)


def example_inputs(
    shape: PieceShape, config: LlamaConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
    device: str = "cpu",
) -> tuple:
    """Inputs of a piece's exact shapes and dtypes, to trace it with (a dynamic piece: example
    counts). Weights are zeros: only their shapes matter, so a compile worker never reads the
    checkpoint."""
    c, t = config, shape.tokens or EXAMPLE_TOKENS
    ids = torch.zeros(t, dtype=torch.int64, device=device)

    def zeros(*size: int) -> Tensor:
        return torch.zeros(size, dtype=dtype, device=device)

    if shape.role == "embed":
        return (ids, ids.clone(), zeros(c.vocab_size, c.hidden_size))
    if shape.role == "head":
        sampling = torch.zeros(shape.samples or EXAMPLE_SAMPLES, dtype=torch.int64, device=device)
        return (zeros(t, c.hidden_size), sampling, zeros(c.hidden_size), zeros(c.vocab_size, c.hidden_size))
    if shape.role == "norm":
        return (zeros(t, c.hidden_size), zeros(c.hidden_size))
    table = torch.full((shape.rows, shape.ctx // block_size), -1, dtype=torch.int64, device=device)
    lens = torch.zeros(shape.rows, dtype=torch.int64, device=device)
    slots = torch.full((t,), -1, dtype=torch.int64, device=device)
    cache = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    weights = example_layer(c, dtype, device).tensors()
    step_rows = 1 if shape.packed else shape.rows  # (B, S); its own tensor: export fakes a view's base
    segments = torch.zeros(step_rows, t // step_rows, dtype=torch.int64, device=device)
    return (zeros(t, c.hidden_size), zeros(t, c.head_dim), zeros(t, c.head_dim), slots, table, lens,
            segments, zeros(*cache), zeros(*cache), weights)


def dynamic_shapes(shape: PieceShape) -> tuple | None:
    """torch.export's ``dynamic_shapes`` of a dynamic piece: any token (and sample) count."""
    if not shape.dynamic:
        return None
    tokens = Dim("tokens", min=1, max=MAX_DYNAMIC)
    if shape.role == "embed":
        return ({0: tokens}, {0: tokens}, None)
    if shape.role == "norm":
        return ({0: tokens}, None)
    return ({0: tokens}, {0: Dim("samples", min=1, max=MAX_DYNAMIC)}, None, None)


__all__ = [
    "PIECES",
    "ROLES",
    "build_piece",
    "BucketRole",
    "PieceShape",
    "bucket_pieces",
    "dynamic_shapes",
    "example_inputs",
]
