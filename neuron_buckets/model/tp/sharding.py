"""One rank's shard of the weights, cut as they are read, by ``LayerWeights`` field.

Column-parallel fields (``qkv``, ``gate_up`` and ``qkv_bias``) keep the rank's output features:
each stacked part (q, k, v; gate, up) is narrowed along dim 0 on its own, q by the rank's heads,
k and v by its KV heads (one of them, replicated, where there are fewer KV heads than ranks, as
vLLM). Row-parallel fields (``o``, ``down``) keep the rank's input features (dim 1): their
products are partial sums, which the layer piece all-reduces, and ``o_bias`` is added once, after
that reduction. Norms are replicated. The embedding and the LM head keep the rank's vocabulary
rows. A quantized projection's scale (``<weight>_scale``) follows its weight's output channels:
one per channel is cut along dim 0 like a column-parallel weight, and stays whole for a
row-parallel one (each rank's partial sum covers every output channel); one for the whole tensor
is replicated. Every cut goes through ``shard_part``. W8A8's per-token activation scales are
computed in the layer piece over the input it is given, so a row-parallel projection quantizes
each rank's own input features, as vLLM does.

The artifact keeps its one weights file and each rank reads its shard from it, tensor by tensor:
a rank never holds more than its shard and one checkpoint tensor, and the disk holds the weights
once whatever the degree (per-rank files would hold them twice, and read no faster).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from neuron_buckets.model.checkpoint_names import LAYER_PARTS, SCALE
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.tp.tensor_parallel import TensorParallel

# The dimension a field's parts are split along; fields not named are replicated.
SPLIT_DIM = {"qkv": 0, "qkv_bias": 0, "gate_up": 0, "o": 1, "down": 1}
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_PART = {name: (field, i) for field, names in LAYER_PARTS.items() for i, name in enumerate(names)}
_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")


def shard_part(tensor: Tensor, dim: int, rank: int, size: int) -> Tensor:
    """Block ``rank`` of ``size`` equal blocks of ``tensor`` along ``dim``, as its own tensor (the
    whole one is freed once every part is cut)."""
    n = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * n, n).clone(memory_format=torch.contiguous_format)


def part_rank(config: LlamaConfig, field: str, part: int, rank: int, tp: TensorParallel) -> tuple[int, int]:
    """(block, blocks) of one stacked part that ``rank`` holds: k and v (parts 1 and 2 of the
    q/k/v fields) by KV heads, replicated over ``size // num_kv_heads`` ranks when fewer."""
    kv = config.num_kv_heads
    if field in ("qkv", "qkv_bias") and part > 0 and kv < tp.size:
        return rank // (tp.size // kv), kv
    return rank, tp.size


def shard_vocab(tensor: Tensor, rank: int, tp: TensorParallel) -> Tensor:
    """The rank's ``vocab_rows`` rows of an embedding or head, zero rows past the vocabulary."""
    rows = tp.vocab_rows(tensor.shape[0])
    out = tensor.new_zeros(rows, *tensor.shape[1:])
    mine = tensor[rank * rows : (rank + 1) * rows]
    out[: mine.shape[0]] = mine
    return out


def shard_tensor(config: LlamaConfig, name: str, tensor: Tensor, rank: int, tp: TensorParallel) -> Tensor:
    """The rank's shard of one checkpoint tensor, by the rule of the field it is a part of."""
    if name in VOCAB:
        return shard_vocab(tensor, rank, tp)
    match = _LAYER.fullmatch(name)
    local = match.group(1) if match else ""
    field, part = _PART.get(local.removesuffix(SCALE), (None, 0))
    if field not in SPLIT_DIM:
        return tensor
    if local.endswith(SCALE):  # a quantized weight's scale: cut with its output channels only
        if SPLIT_DIM[field] != 0 or tensor.numel() == 1:
            return tensor
        return shard_part(tensor, 0, *part_rank(config, field, part, rank, tp))
    return shard_part(tensor, SPLIT_DIM[field], *part_rank(config, field, part, rank, tp))


def read_shard(file: str | Path, config: LlamaConfig, rank: int, tp: TensorParallel,
               device: str = "cpu") -> dict[str, Tensor]:
    """Rank ``rank``'s shard of a safetensors file of ``config``'s checkpoint, by transformers name
    (what ``load_weights`` fuses at the rank-local shapes of ``tp.local(config)``)."""
    shard = {}
    with safe_open(str(file), "pt", device=device) as f:
        for name in f.keys():  # noqa: SIM118  (a safe_open handle is not a dict)
            shard[name] = shard_tensor(config, name, f.get_tensor(name), rank, tp)
    return shard
