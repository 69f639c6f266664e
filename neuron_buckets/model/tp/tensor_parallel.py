"""Tensor parallelism's math: the rank-local shapes, and the collectives the traced pieces call.

Every rank runs the same compiled pieces (SPMD) at rank-local shapes: attention split by heads,
the MLP by intermediate features, the embedding and the head by vocabulary rows (vLLM's split,
``model/tp/sharding.py`` cuts the weights). So one graph per piece serves every rank, as one layer
piece serves every layer, and the graph count does not grow with the degree.

The collectives are torch's functional ones (``_c10d_functional``), called as ops so that tracing
needs no live group of the right size: torch.export keeps them in the graph, AOTInductor lowers
them to calls of the process group registered as ``GROUP`` in the process that runs the graph,
and torch-xla to its collective ops. At size 1 they are the identity and the graph is TP=1's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from neuron_buckets.model.model_config import LlamaConfig

# The default (world) process group's registered name: the one the graphs' collectives call.
GROUP = "0"
_ops = torch.ops._c10d_functional


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel degree: how a model's shapes split, and the collectives that join them."""

    size: int = 1

    def check(self, config: LlamaConfig) -> str | None:
        """Why ``config`` cannot split over ``size`` ranks, or None."""
        n = self.size
        if config.num_heads % n:
            return f"num_attention_heads {config.num_heads} is not a multiple of tensor_parallel_size {n}"
        if config.num_kv_heads % n and n % config.num_kv_heads:
            return (f"num_key_value_heads {config.num_kv_heads} must divide or be a multiple of "
                    f"tensor_parallel_size {n}")
        if config.intermediate_size % n:
            return (f"intermediate_size {config.intermediate_size} is not a multiple of "
                    f"tensor_parallel_size {n}")
        return None

    def local(self, config: LlamaConfig) -> LlamaConfig:
        """The shapes one rank computes: its heads, its KV heads (one replica of one of them where
        there are fewer KV heads than ranks, as vLLM), its MLP features and its vocabulary rows
        (the last rank's padded: the gathered logits are cut back to the vocabulary)."""
        if self.size == 1:
            return config
        if problem := self.check(config):
            raise ValueError(problem)
        return replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=max(1, config.num_kv_heads // self.size),
            intermediate_size=config.intermediate_size // self.size,
            vocab_size=self.vocab_rows(config.vocab_size),
        )

    def vocab_rows(self, vocab_size: int) -> int:
        """Embedding (and head) rows each rank holds."""
        return -(-vocab_size // self.size)

    def vocab_start(self, rank: int, vocab_size: int) -> int:
        """The first vocabulary row of ``rank``'s embedding (and head)."""
        return rank * self.vocab_rows(vocab_size)

    def all_reduce(self, t: Tensor) -> Tensor:
        """The sum over ranks of each rank's partial ``t`` (after a row-parallel projection)."""
        if self.size == 1:
            return t
        return _ops.wait_tensor(_ops.all_reduce(t, "sum", GROUP))

    def all_gather(self, t: Tensor) -> Tensor:
        """Each rank's (N, V) ``t`` side by side, rank after rank: (N, size * V)."""
        if self.size == 1:
            return t
        gathered = _ops.wait_tensor(_ops.all_gather_into_tensor(t.contiguous(), self.size, GROUP))
        return gathered.view(self.size, *t.shape).movedim(0, -2).flatten(-2)

    @contextmanager
    def tracing(self) -> Iterator[None]:
        """A one-process group registered as ``GROUP`` while a piece is traced and compiled:
        inductor looks the collectives' group up by name (only to describe the graph), and a
        compile worker has no ranks to join."""
        if self.size == 1 or dist.is_initialized():
            yield
            return
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            yield
        finally:
            dist.destroy_process_group()


SINGLE = TensorParallel()
