"""Content-addressed keys: a bucket's graph is reused exactly when nothing that shapes it changed.

The key hashes the model config, the source of the code that builds the graph (model, kernels,
example inputs, the compile worker and the backend), the bucket shape, the
cache geometry and dtype, the backend with its compiler/torch versions, flags and device. Weights
are not in it: graphs take them at load time, so new weights of the same model reuse every graph;
nor is max_model_len: each bucket's own ctx bounds its graph.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from neuron_buckets.grid import Bucket

# Cache settings that no graph depends on: a bucket's own ctx bounds what it attends over.
_NOT_IN_GRAPH = ("max_model_len",)
# Code whose text decides what a compiled graph computes or how it is traced (the backend's own
# module is added by the caller). Files, not imports: hashing must not import the compile side.
_HERE = Path(__file__).parent
_GRAPH_SOURCES = tuple(
    _HERE / f for f in ("model.py", "masks.py", "padding.py", "block_table.py", "compile_worker.py")
)


def source_digest(extra: tuple[Path, ...] = ()) -> str:
    """sha256 over the graph-shaping sources and the kernels (file name and bytes, stable order)."""
    from neuron_buckets.kernels.digest import kernel_source_digest

    h = hashlib.sha256(kernel_source_digest().encode())
    for path in sorted((*_GRAPH_SOURCES, *extra), key=lambda p: p.name):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def graph_key(
    *,
    bucket: Bucket,
    model_config: dict[str, Any],
    cache: dict[str, Any],
    backend: dict[str, Any],
    sources: str,
) -> str:
    """sha256 of everything that changes one bucket's compiled graph, as canonical JSON."""
    material = {
        "bucket": [bucket.kind, bucket.batch, bucket.seq, bucket.ctx],
        "model_config": model_config,
        "cache": {k: v for k, v in cache.items() if k not in _NOT_IN_GRAPH},
        "backend": backend,
        "sources": sources,
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
