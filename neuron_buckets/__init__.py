"""neuron-buckets: compile one fixed-shape LLM graph per bucket over a paged block-KV cache.

The public API is importable from here; module paths below are internal. Names load on first
access (PEP 562), so ``import neuron_buckets`` (and every ``nb`` command) stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from neuron_buckets._version import __version__

_PUBLIC = {
    "NULL_BLOCK_ID": "neuron_buckets.core.block_table",
    "PAD_SLOT_ID": "neuron_buckets.core.block_table",
    "compute_slot_mapping": "neuron_buckets.core.block_table",
    "remap_null_block_to_sentinel": "neuron_buckets.core.block_table",
    "gen_cache_mask": "neuron_buckets.core.masks",
    "Bucket": "neuron_buckets.core.bucket",
    "NoBucketFits": "neuron_buckets.core.bucket",
    "select_bucket": "neuron_buckets.core.bucket",
    "BlockPool": "neuron_buckets.engine.block_pool",
    "PrefillChunk": "neuron_buckets.runtime.prefill_chunk",
    "PaddedCall": "neuron_buckets.core.padding",
    "Segment": "neuron_buckets.core.step_plan",
    "StepPlan": "neuron_buckets.core.step_plan",
    "Config": "neuron_buckets.config",
    "ConfigError": "neuron_buckets.config",
    "load_config": "neuron_buckets.config",
    "enumerate_grid": "neuron_buckets.config",
    "Manifest": "neuron_buckets.artifact.manifest",
    "ManifestError": "neuron_buckets.artifact.manifest",
    "read_manifest": "neuron_buckets.artifact.manifest",
    "BucketRuntime": "neuron_buckets.runtime.bucket_runtime",
    "ArtifactError": "neuron_buckets.runtime.bucket_runtime",
    "LLMEngine": "neuron_buckets.engine.llm_engine",
    "generate": "neuron_buckets.engine.llm_engine",
    "SamplingParams": "neuron_buckets.engine.sampling_params",
    "RequestOutput": "neuron_buckets.engine.request_output",
    "Tokenizer": "neuron_buckets.engine.tokenizer",
    "Compiler": "neuron_buckets.compile.compiler",
}

__all__ = [
    "__version__",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "compute_slot_mapping",
    "remap_null_block_to_sentinel",
    "gen_cache_mask",
    "Bucket",
    "NoBucketFits",
    "select_bucket",
    "BlockPool",
    "PrefillChunk",
    "PaddedCall",
    "Segment",
    "StepPlan",
    "Config",
    "ConfigError",
    "load_config",
    "enumerate_grid",
    "Manifest",
    "ManifestError",
    "read_manifest",
    "BucketRuntime",
    "ArtifactError",
    "LLMEngine",
    "generate",
    "SamplingParams",
    "RequestOutput",
    "Tokenizer",
    "Compiler",
]

if TYPE_CHECKING:
    from neuron_buckets.artifact.manifest import Manifest, ManifestError, read_manifest
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import Config, ConfigError, enumerate_grid, load_config
    from neuron_buckets.core.block_table import (
        NULL_BLOCK_ID,
        PAD_SLOT_ID,
        compute_slot_mapping,
        remap_null_block_to_sentinel,
    )
    from neuron_buckets.core.bucket import Bucket, NoBucketFits, select_bucket
    from neuron_buckets.core.masks import gen_cache_mask
    from neuron_buckets.core.padding import PaddedCall
    from neuron_buckets.core.step_plan import Segment, StepPlan
    from neuron_buckets.engine.block_pool import BlockPool
    from neuron_buckets.engine.llm_engine import LLMEngine, generate
    from neuron_buckets.engine.request_output import RequestOutput
    from neuron_buckets.engine.sampling_params import SamplingParams
    from neuron_buckets.engine.tokenizer import Tokenizer
    from neuron_buckets.runtime.bucket_runtime import ArtifactError, BucketRuntime
    from neuron_buckets.runtime.prefill_chunk import PrefillChunk


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'neuron_buckets' has no attribute {name!r}")
