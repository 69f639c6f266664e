"""What ``BucketRuntime.open`` checks in a schema-valid manifest before it allocates anything.

The schema says each value has the right type; this says they fit together, fit the pieces and
fit this machine: nobody but the owner can change the files (``utils/owner_only.py``), every
piece was compiled for the manifest's cache geometry, model config and dtype as they stand now
(each piece records them, ``Manifest.graph_facts``), every bucket names the pieces of its own
shape, the model config is a complete Llama config, the cache geometry is the model's and can
hold one sequence, every bucket lies within it, the device exists here, and the cache with the
largest step fits in memory. Each failure names the manifest and the value, not a KeyError, an
allocator's traceback or a graph's abort in native code.

A graph is loaded from a private copy whose bytes were hashed as they were copied
(``verified_copy``): what runs is what was checked, even if the file is replaced in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from neuron_buckets.artifact.manifest import (
    GRAPHS,
    KERNELS,
    MANIFEST,
    TOKENIZER,
    CacheGeometry,
    Manifest,
    ManifestError,
)
from neuron_buckets.config.cache import geometry_problem
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.model_config import LlamaConfig, parse_hf_config
from neuron_buckets.model.pieces import bucket_pieces
from neuron_buckets.model.tp.tensor_parallel import TensorParallel
from neuron_buckets.runtime.memory import check_memory, serving_needs
from neuron_buckets.utils.errors import UserError
from neuron_buckets.utils.files import checked_copy
from neuron_buckets.utils.owner_only import check_owner_only

MISSING = "(absent)"


class ArtifactError(UserError, RuntimeError):
    """A graph or weights file that is missing or does not match its manifest entry."""


def check_artifact_files(directory: Path) -> None:
    """The directory, its manifest and the folders nb loads code and data from: owner-writable only."""
    for rel in (".", MANIFEST, GRAPHS, KERNELS, TOKENIZER):
        check_owner_only(directory / rel, "artifact directory" if rel == "." else "artifact file")


def _compiled_for_problem(manifest: Manifest) -> str | None:
    """The first manifest value that differs from what a working piece was compiled for."""
    facts = manifest.graph_facts()
    used = {key for b in manifest.buckets if b.status == "ok" for key in b.pieces.values()}
    for key in sorted(used):
        rec = manifest.pieces[key]
        if rec.compiled_for is None:
            return (f"piece {rec.name} does not record what it was compiled for (an older nb); "
                    f"run nb compile again")
        for name in sorted(facts.keys() | rec.compiled_for.keys()):
            now, then = facts.get(name, MISSING), rec.compiled_for.get(name, MISSING)
            if now != then:
                return (f"{name} is {now!r}, but piece {rec.name} was compiled for {then!r}; the manifest "
                        f"was edited: restore it, or run nb compile again for the new value")
    return None


def _bucket_piece_problem(manifest: Manifest, dynamic: bool) -> str | None:
    """A working bucket whose pieces were compiled for another shape (its batch or seq edited)."""
    decode_seq = min((b.seq for b in manifest.buckets if b.kind == "decode"), default=1)
    for i, b in enumerate(manifest.buckets):
        if b.status != "ok":
            continue
        # every optional piece too: a bucket may lack its fresh layer (compiled without one)
        expected = bucket_pieces(Bucket(b.kind, b.batch, b.seq, b.ctx), dynamic, decode_seq, fresh=True,
                                 embedding=manifest.embedding is not None)
        for role, key in b.pieces.items():
            rec = manifest.pieces[key]
            if role not in expected or (rec.role, rec.name) != (expected[role].role, expected[role].name):
                want = expected[role].name if role in expected else "no such role"
                return (f"buckets/{i} ({b.kind} batch {b.batch} seq {b.seq} ctx {b.ctx}) names piece "
                        f"{rec.name} as its {role}, compiled for another shape ({want} expected); "
                        f"the manifest was edited: restore it, or run nb compile again")
    return None


@contextlib.contextmanager
def verified_copy(path: Path, sha256: str, what: str) -> Iterator[Path]:
    """``checked_copy`` of a file nb runs as code, once its owner alone can change it; ``what``
    names it in a refusal."""
    check_owner_only(path, what)
    with checked_copy(path, sha256) as copy:
        yield copy


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


def check_servable(manifest: Manifest, directory: Path, device: str, dynamic: bool) -> LlamaConfig:
    """The artifact's model config, once the manifest's values fit its pieces, together, and this
    machine. ``dynamic``: the backend compiles one embed and one head for every bucket."""
    where = directory / MANIFEST
    check_artifact_files(directory)
    for problem in (_compiled_for_problem(manifest), _bucket_piece_problem(manifest, dynamic)):
        if problem:
            raise ManifestError(f"{where}: {problem}")
    model = parse_hf_config(manifest.model.config, f"{where} model.config")
    tp = TensorParallel(manifest.parallel.tensor_parallel_size)
    if problem := tp.check(model):
        raise ManifestError(f"{where}: {problem}")
    local = tp.local(model)  # what one rank holds: its cache's KV heads, its memory
    buckets = [r.bucket for r in manifest.buckets]
    if problem := _geometry_problem(manifest.cache, local, buckets):
        raise ManifestError(f"{where}: {problem}")
    if problem := _device_problem(device):
        raise ManifestError(f"{where}: cannot serve on device {device!r}: {problem}")
    if device.split(":")[0] == "cpu":
        geo = manifest.cache
        needs = serving_needs(local, buckets, geo.num_blocks, geo.block_size, geo.dtype)
        check_memory(needs, f"serving {directory}" + (f" (one of {tp.size} ranks)" if tp.size > 1 else ""))
    return model
