"""The whole config: its sections, and the rules that join them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from neuron_buckets.config.bucket_sizes import bucket_sizes
from neuron_buckets.config.buckets import BucketConfig, default_contexts
from neuron_buckets.config.cache import CacheConfig
from neuron_buckets.config.compile import CompileConfig
from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.lora import LoraConfig
from neuron_buckets.config.model import ModelSource
from neuron_buckets.config.parallel import ParallelConfig
from neuron_buckets.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class Config:
    model: ModelSource
    cache: CacheConfig
    buckets: BucketConfig
    compile: CompileConfig
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        """Decode contexts and speculation against the cache: derived when left out, and each
        context a whole number of blocks, the last ``max_model_len``."""
        b, c, key = self.buckets, self.cache, "buckets.decode_context_length_buckets"
        spec = b.decode_context_length_buckets
        if spec is None:
            contexts = default_contexts(c.block_size, c.max_model_len)
        else:
            contexts = bucket_sizes(key, spec, c.max_model_len, "cache.max_model_len")
        for ctx in contexts:
            if ctx % c.block_size:
                raise ConfigError(f"{key}: {ctx} is not a multiple of cache.block_size={c.block_size}")
        if b.speculation_length + 1 > c.max_model_len:
            raise ConfigError("buckets.speculation_length must be below cache.max_model_len")
        if self.speculative.uses_draft_model and self.speculative.draft_model is None:
            raise ConfigError(
                "speculative.draft_model: method 'draft_model' needs the draft checkpoint's directory"
            )
        if self.speculative.uses_draft_model and self.parallel.tensor_parallel_size > 1:
            raise ConfigError(
                "speculative.method: 'draft_model' runs on one rank; with parallel.tensor_parallel_size > 1 "
                "draft with 'ngram'"
            )
        if self.model.embeds and self.parallel.tensor_parallel_size > 1:
            raise ConfigError('model.task: "embed" runs on one rank; set parallel.tensor_parallel_size = 1')
        if self.model.embeds and b.speculation_length:
            raise ConfigError('buckets.speculation_length: an embedding artifact (model.task = "embed") '
                              "has no decode steps to speculate; leave it 0")
        if self.lora.enabled and self.compile.backend not in ("inductor", "eager"):
            raise ConfigError(f"lora.max_loras: LoRA slots are built for the inductor and eager backends, "
                              f"not {self.compile.backend!r} yet")
        if self.lora.enabled and self.parallel.tensor_parallel_size > 1:
            raise ConfigError("lora.max_loras: LoRA slots run on one rank; "
                              "set parallel.tensor_parallel_size = 1")
        if contexts != spec:
            object.__setattr__(self, "buckets", replace(b, decode_context_length_buckets=contexts))
