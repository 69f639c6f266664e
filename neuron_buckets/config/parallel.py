"""``[parallel]``: over how many ranks the model is split (tensor parallelism, vLLM's name).

``tensor_parallel_size`` ranks each hold one shard of the weights and of the KV cache and run the
same compiled pieces at one rank's shapes (``model/tp/tensor_parallel.py``), so it shapes every
graph: the pieces' tensors and the collectives in them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from neuron_buckets.config.setting import check_positive, check_types, setting


@dataclass(frozen=True)
class ParallelConfig:
    SECTION: ClassVar[str] = "parallel"

    tensor_parallel_size: int = setting(1, graph=True)

    def __post_init__(self) -> None:
        check_types(self)
        check_positive(self, "tensor_parallel_size")
