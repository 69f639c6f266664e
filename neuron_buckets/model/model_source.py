"""Which weights ``[model] path`` names: the embedded default (no path), a Hugging Face style
directory (``checkpoint.py``) or a GGUF file (``gguf_checkpoint.py``). The compile stage asks
here, so each format stays in its own module and only this one tells them apart.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from neuron_buckets.model import checkpoint, gguf_checkpoint
from neuron_buckets.model.checkpoint import (
    DEFAULT_CONFIG,
    check_shards,
    default_model,
    load_model,
    load_weights,
    read_config,
)
from neuron_buckets.model.gguf_checkpoint import check_gguf, is_gguf, read_gguf_state_dict
from neuron_buckets.model.llama import Llama
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.utils.files import sha256_file


def model_config_of(source: Path | None) -> LlamaConfig:
    """The config of a source, after a look at every shard's header or every GGUF tensor's record
    (cheap: no tensors read), so a bad checkpoint fails before anything is written or started."""
    if source is None:
        return DEFAULT_CONFIG
    if is_gguf(source):
        return check_gguf(source)
    config = read_config(source)
    check_shards(source)
    return config


def build_model(source: Path | None, dtype: torch.dtype) -> Llama:
    """The model of a source, weights cast (or dequantized) to ``dtype``."""
    if source is None:
        return default_model(dtype)
    if is_gguf(source):
        config = check_gguf(source)
        return Llama(config, load_weights(config, read_gguf_state_dict(source, config, dtype), dtype))
    return load_model(source, dtype)


def weights_fingerprint(source: Path | None, dtype: torch.dtype) -> str:
    """A cheap identity of the weights a source yields, to skip rewriting unchanged weights.

    Checkpoint directories: the names, sizes and modification times of their files; a GGUF file:
    its sha256 and the code that reads it (names, permutation, dequantization); the default: the
    checkpoint module's source and the weights layout's (seed, init, draw order) and the torch
    version (its random generator).
    """
    h = hashlib.sha256(str(dtype).encode())
    if source is None:
        for module in (Path(checkpoint.__file__), Path(checkpoint.__file__).with_name("weights.py")):
            h.update(module.read_bytes())
        h.update(torch.__version__.encode())
    elif is_gguf(source):
        h.update(sha256_file(source).encode())  # what the weights were made from
        h.update(Path(gguf_checkpoint.__file__).read_bytes())
    else:
        for f in sorted(Path(source).glob("*")):
            if f.suffix in (".safetensors", ".json"):
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()
