"""Content-addressed keys: a piece's graph is reused exactly when nothing that shapes it changed.

The key hashes the model config, the source of the code that builds the graph (model, kernels,
example inputs, the compile worker and the backend), the piece's role and shape, the
cache geometry and dtype, the backend with its compiler/torch versions, flags and device. Weights
are not in it: graphs take them at load time, so new weights of the same model reuse every graph;
nor is max_model_len: each bucket's own ctx bounds its graph.
"""

from __future__ import annotations

import hashlib
import json
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from neuron_buckets.backends import Backend
from neuron_buckets.model.pieces import PieceShape

# Cache settings that no graph depends on: a bucket's own ctx bounds what it attends over.
_NOT_IN_GRAPH = ("max_model_len",)
# Code whose text decides what a compiled graph computes or how it is traced (the backend's own
# module is added by the caller): the model, the core step semantics, the compile worker, and
# every kernel (goldens and NKI sources), so that editing any of them invalidates cached graphs.
_GRAPH_SOURCE_PACKAGES = ("neuron_buckets.model", "neuron_buckets.core", "neuron_buckets.kernels")
_GRAPH_SOURCE_FILES = (Path(__file__).with_name("worker.py"),)


def package_sources() -> list[Path]:
    """The graph-shaping files of the installed package, found without importing them."""
    dirs = [Path(find_spec(name).origin).parent for name in _GRAPH_SOURCE_PACKAGES]
    return [*(p for d in dirs for p in d.rglob("*.py")), *_GRAPH_SOURCE_FILES]


def graph_sources(extra: tuple[Path, ...] = ()) -> list[Path]:
    """The files ``source_digest`` hashes, ordered by the name it hashes (not their location)."""
    return sorted({*package_sources(), *extra}, key=lambda p: (p.parent.name, p.name))


def source_digest(extra: tuple[Path, ...] = ()) -> str:
    """sha256 over the graph-shaping sources: each file's name and bytes. Files, not imports:
    hashing must not import the code it hashes. Names are hashed with the bytes so that moving
    code between files also changes the digest."""
    h = hashlib.sha256()
    for path in graph_sources(extra):
        h.update(f"{path.parent.name}/{path.name}\0".encode())
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def backend_source_digest(backend: Backend) -> str:
    """``source_digest`` with the backend's own module, or the modules it names in ``source_modules``
    when its graphs are shaped by more (the xla backend's: its lowering and the Neuron backend's
    traced modules): what the driver keys with and what every worker, on whatever node, checks it
    would compile."""
    modules = getattr(backend, "source_modules", (type(backend).__module__,))
    return source_digest(extra=tuple(Path(sys.modules[m].__file__) for m in modules))


def graph_key(
    *,
    piece: PieceShape,
    model_config: dict[str, Any],
    cache: dict[str, Any],
    backend: dict[str, Any],
    sources: str,
) -> str:
    """sha256 of everything that changes one piece's compiled graph, as canonical JSON."""
    material = {
        "piece": [piece.role, piece.tokens, piece.rows, piece.ctx, piece.samples],
        "model_config": model_config,
        "cache": {k: v for k, v in cache.items() if k not in _NOT_IN_GRAPH},
        "backend": backend,
        "sources": sources,
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
