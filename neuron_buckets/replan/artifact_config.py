"""The config an artifact was compiled from, read back from its manifest.

A re-plan changes the token buckets and nothing else: the model, dtype, cache geometry, limits,
backend and its flags stay the manifest's, so every piece a kept bucket runs gets the key it was
compiled under (``replanner.py`` checks that) and comes from the artifact, not a worker.
"""

from __future__ import annotations

from pathlib import Path

from neuron_buckets.artifact.manifest import Manifest
from neuron_buckets.config import Config
from neuron_buckets.config.buckets import BucketConfig
from neuron_buckets.config.cache import CacheConfig
from neuron_buckets.config.compile import CompileConfig
from neuron_buckets.config.model import ModelSource
from neuron_buckets.config.parallel import ParallelConfig

EMBEDDED = "embedded-default"  # the manifest's model.source for the embedded model


def config_of(manifest: Manifest, jobs: int = 1) -> Config:
    """The config whose build plan is ``manifest``'s (``jobs`` local compile workers)."""
    c, d = manifest.cache, manifest.decode
    embedding = manifest.embedding
    model = ModelSource(
        path=None if manifest.model.source == EMBEDDED else Path(manifest.model.source),
        task="embed" if embedding else "generate",
        **({"pooling": embedding.pooling, "normalize": embedding.normalize} if embedding else {}),
    )
    prefill = [b for b in manifest.buckets if b.kind == "prefill"]
    decode = [b for b in manifest.buckets if b.kind == "decode"]
    buckets = BucketConfig(
        max_num_seqs=d.max_num_seqs,
        max_num_batched_tokens=d.max_num_batched_tokens,
        num_batched_tokens_buckets=tuple(sorted({b.seq for b in prefill})),
        **({} if embedding else {
            "num_seqs_buckets": tuple(sorted({b.batch for b in decode})),
            "decode_context_length_buckets": tuple(sorted({b.ctx for b in decode})),
            "speculation_length": d.speculation_length,
        }),
    )
    cache = CacheConfig(block_size=c.block_size, num_blocks=c.num_blocks, max_model_len=c.max_model_len,
                        dtype=c.dtype, enable_prefix_caching=d.enable_prefix_caching)
    compile_ = CompileConfig(
        backend=manifest.backend.name, device=manifest.backend.device, flags=dict(manifest.backend.flags),
        jobs=jobs, fresh_layers=any("fresh_layer" in b.pieces for b in prefill),
    )
    parallel = ParallelConfig(manifest.parallel.tensor_parallel_size)
    return Config(model, cache, buckets, compile_, parallel=parallel)
