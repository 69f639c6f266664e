"""What ``BucketRuntime.open`` checks in a schema-valid manifest before it allocates anything.

The schema says each value has the right type; this says they fit together and fit this
machine: the model config is a complete Llama config, the cache geometry is the model's and can
hold one sequence, every bucket lies within it, the device exists here, and the cache with the
largest step fits in memory. Each failure names the manifest and the value, not a KeyError or
an allocator's traceback.
"""

from __future__ import annotations

from pathlib import Path

import torch

from neuron_buckets.artifact.manifest import MANIFEST, CacheGeometry, Manifest, ManifestError
from neuron_buckets.config.cache import geometry_problem
from neuron_buckets.config.memory import check_memory, serving_needs
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.model_config import LlamaConfig, parse_hf_config


def _geometry_problem(cache: CacheGeometry, model: LlamaConfig, buckets: list[Bucket]) -> str | None:
    expected = {k: getattr(model, k) for k in ("num_layers", "num_kv_heads", "head_dim")}
    if wrong := {k: getattr(cache, k) for k, v in expected.items() if getattr(cache, k) != v}:
        return f"cache geometry {wrong} does not match the model config {expected}"
    if problem := geometry_problem(cache):
        return problem
    for b in buckets:
        if b.ctx > cache.max_model_len or b.ctx % cache.block_size:
            return f"bucket {b.name} has ctx {b.ctx} outside the cache"
    return None


def _device_problem(device: str) -> str | None:
    """Why ``device`` cannot hold tensors here, for the device types torch itself knows."""
    if not device.startswith("cuda"):
        return None  # cpu always works; the neuron backend checks its own device when loading
    try:
        index = torch.device(device).index or 0
    except RuntimeError as e:  # not a device string
        return str(e)
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def check_servable(manifest: Manifest, directory: Path, device: str) -> LlamaConfig:
    """The artifact's model config, once the manifest's values fit together and this machine."""
    where = directory / MANIFEST
    model = parse_hf_config(manifest.model.config, f"{where} model.config")
    buckets = [r.bucket for r in manifest.buckets]
    if problem := _geometry_problem(manifest.cache, model, buckets):
        raise ManifestError(f"{where}: {problem}")
    if problem := _device_problem(device):
        raise ManifestError(f"{where}: cannot serve on device {device!r}: {problem}")
    if device.split(":")[0] == "cpu":
        geo = manifest.cache
        needs = serving_needs(model, buckets, geo.num_blocks, geo.block_size, geo.dtype)
        check_memory(needs, f"serving {directory}")
    return model
