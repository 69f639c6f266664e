"""The limits both servers of a matrix cell run under, and the KV capacity they share.

Fair conditions are the point: the same ``max_model_len``, ``max_num_seqs`` and
``max_num_batched_tokens``, and the same bytes of KV cache. vLLM CPU takes its cache as whole GiB
(``VLLM_CPU_KVCACHE_SPACE``); nb takes ``num_blocks`` blocks of ``block_size`` tokens, so nb gets
the blocks whose bytes (K and V, every layer, in the served dtype) come nearest that size from
below. Block 0 is nb's null block and holds no request's tokens, so nb's usable capacity is one
block less than vLLM's, never more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .real_models import Shape

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

NB_CONFIG = """
[model]
path = "{model}"

[cache]
block_size = {block_size}
num_blocks = {num_blocks}
max_model_len = {max_model_len}
dtype = "{dtype}"

[buckets]
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = {max_num_batched_tokens}
{buckets}

[compile]
backend = "inductor"
jobs = 2
"""


@dataclass(frozen=True)
class ServeLimits:
    """One cell's limits; nb's bucket grid is its default for them unless ``buckets`` adds lines."""

    max_model_len: int = 1024
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_gib: int = 1

    def bytes_per_token(self, shape: Shape, dtype: str) -> int:
        return shape.kv_elements_per_token * DTYPE_BYTES[dtype]

    def num_blocks(self, shape: Shape, dtype: str) -> int:
        """nb's blocks: num_blocks x block_size x bytes per token <= the GiB vLLM gets."""
        return self.kv_cache_gib * GIB // (self.block_size * self.bytes_per_token(shape, dtype))

    def nb_config(self, model: Path, shape: Shape, dtype: str, buckets: str = "") -> str:
        """The TOML ``nb compile`` reads for this cell."""
        return NB_CONFIG.format(model=model.as_posix(), num_blocks=self.num_blocks(shape, dtype), dtype=dtype,
                                buckets=buckets, **vars(self))

    def vllm_args(self, dtype: str) -> list[str]:
        """vLLM's server flags for the same limits (its cache size goes in its environment)."""
        return ["--dtype", dtype, "--max-model-len", str(self.max_model_len), "--max-num-seqs",
                str(self.max_num_seqs), "--max-num-batched-tokens", str(self.max_num_batched_tokens)]

    def vllm_env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}

    def kv_cell(self, shape: Shape, dtype: str) -> str:
        """The KV capacity as a table cell: nb's blocks and their bytes against vLLM's GiB."""
        per = self.bytes_per_token(shape, dtype)
        blocks = self.num_blocks(shape, dtype)
        return f"{self.kv_cache_gib} GiB = {blocks} x {self.block_size} x {per} B"

    def describe(self) -> str:
        return (f"max_model_len {self.max_model_len}, max_num_seqs {self.max_num_seqs}, "
                f"max_num_batched_tokens {self.max_num_batched_tokens}, KV {self.kv_cache_gib} GiB each")
