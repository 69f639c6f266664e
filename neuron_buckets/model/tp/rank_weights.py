"""One rank's weights, read from the artifact's one file: tensor parallelism applied at load.

gpt-fast shards a loaded model (``tp.py``); here each rank reads only its shard
(``sharding.py``), at the rank-local shapes (``TensorParallel.local``), so no rank holds the whole
model. At one rank the file is read whole, as it is: the runtime loads every artifact this way.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file
from torch import Tensor

from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.tp.sharding import read_shard
from neuron_buckets.model.tp.tensor_parallel import TensorParallel


def rank_tensors(file: Path, config: LlamaConfig, rank: int, tp: TensorParallel,
                 device: str) -> tuple[LlamaConfig, dict[str, Tensor]]:
    """The config of the shapes ``rank`` computes and its shard of ``file``'s tensors, by
    transformers name: what ``load_weights`` fuses."""
    if tp.size == 1:
        return config, load_file(file, device=device)
    return tp.local(config), read_shard(file, config, rank, tp, device)
