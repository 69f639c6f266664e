"""Content-addressed keys: a piece's graph is reused exactly when nothing that shapes it changed.

The key hashes the model config, the source of the code that builds the graph (model, kernels,
the graph contract in core, the compile worker and the backend), the piece's role and shape, the
cache geometry and dtype, the backend with its compiler/torch versions, flags and device. Weights
are not in it: graphs take them at load time, so new weights of the same model reuse every graph;
nor is any setting its config section declares ``graph=False`` (max_model_len: each bucket's own
ctx bounds its graph). The engine, the runtime, the server and the utilities are not hashed
either: editing a scheduler or an error message recompiles nothing.
"""

from __future__ import annotations

import hashlib
import json
from importlib import import_module
from pathlib import Path
from typing import Any

from neuron_buckets.backends import Backend
from neuron_buckets.config import CacheConfig
from neuron_buckets.config.setting import not_in_graph
from neuron_buckets.model.pieces import PieceShape

PACKAGE_ROOT = Path(__file__).parent.parent
# The kernels' folder as imports reach it: the top-level kernels/ of a checkout, or its place in a
# built package (pyproject's package-dir). Its __init__ holds no code, so finding it runs none.
KERNELS_ROOT = Path(import_module("neuron_buckets.kernels").__path__[0])
# Code whose text decides what a compiled graph computes or how it is traced (the backend's own
# module is added by the caller), relative to the package: the model, the graph contract (core),
# every kernel (goldens and NKI sources, in KERNELS_ROOT) and the compile worker, so that editing
# any of them invalidates cached graphs.
GRAPH_SOURCES = ("model", "core", "compile/worker.py")


def package_sources() -> list[Path]:
    """The graph-shaping files of the installed package, found without importing them."""
    paths = [PACKAGE_ROOT / name for name in GRAPH_SOURCES] + [KERNELS_ROOT]
    return [s for p in paths for s in (p.rglob("*.py") if p.is_dir() else [p])]


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
    # neuron_buckets.backends.<name>, found by path so that hashing imports nothing
    paths = (PACKAGE_ROOT.joinpath(*m.split(".")[1:]).with_suffix(".py") for m in modules)
    return source_digest(extra=tuple(paths))


def graph_key(
    *,
    piece: PieceShape,
    model_config: dict[str, Any],
    cache: dict[str, Any],
    backend: dict[str, Any],
    sources: str,
    tensor_parallel_size: int = 1,
    lora: dict[str, Any] | None = None,
) -> str:
    """sha256 of everything that changes one piece's compiled graph, as canonical JSON (the
    tensor-parallel degree where above 1: its pieces have one rank's shapes and collectives; a
    layer piece's LoRA slots, where it has them: embed and head pieces stay shared)."""
    material = {
        "piece": [piece.role, piece.tokens, piece.rows, piece.ctx, piece.samples, piece.packed],
        "model_config": model_config,
        "cache": {k: v for k, v in cache.items() if k not in not_in_graph(CacheConfig)},
        "backend": backend,
        "sources": sources,
    }
    if tensor_parallel_size > 1:
        material["tensor_parallel_size"] = tensor_parallel_size
    if lora is not None and piece.role == "layer":
        material["lora"] = lora
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
