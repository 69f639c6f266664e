"""The artifact directory's ``manifest.json``: what was built, from what, and how to check it.

Read by the runtime, written by the compiler, validated against ``manifests/manifest.schema.json``
both ways, and handed to every reader as the typed ``Manifest`` (one place knows the keys).
Writes are atomic (temp file, fsync, rename): a crash leaves the old manifest or the new one,
never half of either. All paths inside are relative, so a directory can be moved.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from neuron_buckets.core.bucket import Bucket
from neuron_buckets.utils.files import atomic_write
from neuron_buckets.utils.package_data import read_package_data

SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
GRAPHS = "graphs"
KERNELS = "kernels"  # native kernel libraries the graphs call
TOKENIZER = "tokenizer"
# Files that make a tokenizer (as opposed to generation_config.json, copied beside them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class ManifestError(ValueError):
    """A manifest that is missing, malformed, from a newer toolchain, or inconsistent with files."""


def schema() -> dict[str, Any]:
    text = read_package_data("manifest.schema.json")
    return json.loads(text)


def validate(manifest: dict[str, Any], where: str = MANIFEST) -> dict[str, Any]:
    """Check the version first (a newer schema gets its own message), then the whole schema."""
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int):
        raise ManifestError(f"{where}: no integer schema_version; not an nb manifest")
    if version > SCHEMA_VERSION:
        raise ManifestError(
            f"{where}: schema_version {version} is newer than this toolchain supports "
            f"({SCHEMA_VERSION}); upgrade neuron-buckets"
        )
    if version < SCHEMA_VERSION:
        raise ManifestError(
            f"{where}: schema_version {version} was written by an older neuron-buckets (whole-model "
            f"graphs); run nb compile again to rebuild it as layer pieces (schema {SCHEMA_VERSION})"
        )
    try:
        jsonschema.validate(manifest, schema())
    except jsonschema.ValidationError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ManifestError(f"{where}: invalid at {at}: {e.message}") from None
    return manifest


@dataclass(frozen=True)
class BackendInfo:
    name: str
    device: str
    versions: dict[str, str]
    flags: dict[str, Any]


@dataclass(frozen=True)
class ModelInfo:
    source: str
    config: dict[str, Any]  # the Hugging Face style config.json
    dtype: str


@dataclass(frozen=True)
class WeightsInfo:
    file: str
    sha256: str
    bytes: int
    source_fingerprint: str | None = None


@dataclass(frozen=True)
class LibraryInfo:
    """A native kernel library the graphs call (``kernels/``), loaded before any graph."""

    file: str
    sha256: str


@dataclass(frozen=True)
class CacheGeometry:
    block_size: int
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_model_len: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Each of the K and V caches: (layers, blocks, block_size, kv_heads, head_dim)."""
        return (self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class DecodeInfo:
    speculation_length: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True  # absent from manifests written before prefix caching


@dataclass(frozen=True)
class ParallelInfo:
    """Tensor parallelism: every rank runs the same pieces over its shard of the weights and of
    the KV cache (``cache.num_kv_heads`` is one rank's)."""

    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class LoraInfo:
    """Adapter slots (``[lora]``): every layer piece takes ``max_loras + 1`` slots of
    ``max_lora_rank`` for the ``target_modules`` (``model/lora.py``). Absent: no LoRA."""

    max_loras: int
    max_lora_rank: int
    target_modules: list[str]


@dataclass(frozen=True)
class EmbeddingInfo:
    """An embedding artifact (``model.task = "embed"``): prefill buckets ending in the final-norm
    piece, whose hidden states are pooled (``last`` token or ``mean``) and, with ``normalize``,
    L2-normalized. Absent: a generation artifact."""

    pooling: str
    normalize: bool


@dataclass(frozen=True)
class TextInfo:
    """What turns the model's ids into text and ends a generation: the tokenizer files copied into
    ``tokenizer/`` (relative path -> sha256) and the end-of-sequence ids of the model directory's
    ``generation_config.json``, else its ``config.json`` (none: every request runs to its length)."""

    eos_token_ids: list[int]
    files: dict[str, str]

    @property
    def has_tokenizer(self) -> bool:
        return any(Path(f).name in TOKENIZER_FILES for f in self.files)


@dataclass
class PieceRecord:
    """One compiled graph file: an embed, layer, head or norm piece, shared by the buckets that use it."""

    role: str
    name: str
    file: str
    sha256: str | None
    bytes: int = 0
    compile_seconds: float = 0.0
    cached: bool = False
    status: str = "ok"
    error: str | None = None
    log: str | None = None
    # ``graph_facts`` of the manifest it was compiled with: the runtime refuses one that differs
    # (None: compiled before nb recorded it; refused too)
    compiled_for: dict[str, Any] | None = None


@dataclass
class BucketRecord:
    """One bucket: its shape, the keys of its pieces (three, and a fresh layer where compiled), and
    whether all of them work."""

    kind: str
    batch: int
    seq: int
    ctx: int
    pieces: dict[str, str]  # role -> piece key
    status: str = "ok"
    error: str | None = None

    @property
    def bucket(self) -> Bucket:
        return Bucket(self.kind, self.batch, self.seq, self.ctx)  # type: ignore[arg-type]  # schema-checked kind


@dataclass
class Manifest:
    toolchain: dict[str, str]
    backend: BackendInfo
    model: ModelInfo
    cache: CacheGeometry
    decode: DecodeInfo
    weights: WeightsInfo | None = None
    text: TextInfo | None = None  # None in manifests written before nb copied tokenizers
    libraries: dict[str, LibraryInfo] = field(default_factory=dict)
    parallel: ParallelInfo = field(default_factory=ParallelInfo)
    lora: LoraInfo | None = None
    embedding: EmbeddingInfo | None = None
    pieces: dict[str, PieceRecord] = field(default_factory=dict)
    buckets: list[BucketRecord] = field(default_factory=list)
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = MANIFEST) -> Manifest:
        """A manifest dict that ``validate`` accepted, typed; every piece a working bucket names
        exists (a failed bucket may name pieces a stopped run never reached)."""
        for i, b in enumerate(d["buckets"]):
            if b["status"] == "ok" and (missing := sorted(set(b["pieces"].values()) - set(d["pieces"]))):
                raise ManifestError(f"{where}: invalid at buckets/{i}/pieces: no piece {missing[0]}")
        return cls(
            toolchain=d["toolchain"],
            backend=BackendInfo(**d["backend"]),
            model=ModelInfo(**d["model"]),
            cache=CacheGeometry(**d["cache"]),
            decode=DecodeInfo(**d["decode"]),
            weights=WeightsInfo(**d["weights"]),
            text=TextInfo(**d["text"]) if "text" in d else None,
            libraries={k: LibraryInfo(**v) for k, v in d.get("libraries", {}).items()},
            parallel=ParallelInfo(**d.get("parallel", {})),
            lora=LoraInfo(**d["lora"]) if "lora" in d else None,
            embedding=EmbeddingInfo(**d["embedding"]) if "embedding" in d else None,
            pieces={k: PieceRecord(**v) for k, v in d["pieces"].items()},
            buckets=[BucketRecord(**b) for b in d["buckets"]],
            created=d["created"],
            schema_version=d["schema_version"],
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["text"] is None:
            del d["text"]
        if not d["libraries"]:
            del d["libraries"]
        if self.parallel == ParallelInfo():
            del d["parallel"]
        if self.embedding is None:
            del d["embedding"]
        if self.lora is None:
            del d["lora"]
        for piece in d["pieces"].values():
            if piece["compiled_for"] is None:
                del piece["compiled_for"]
        return d

    def graph_facts(self) -> dict[str, Any]:
        """Every value of this manifest that a compiled piece depends on, by its path here.

        A graph takes its cache, weights and step tensors at fixed shapes and dtypes, and no
        backend checks them at call time (AOTInductor only with ``AOTI_RUNTIME_CHECK_INPUTS``):
        a cache allocated from an edited ``num_blocks`` or ``block_size`` is read and written
        past what the graph was built for. So each piece records these when it is compiled and
        the runtime compares them before it allocates anything.
        """
        facts: dict[str, Any] = {f"cache.{k}": v for k, v in asdict(self.cache).items()}
        facts |= {f"model.config.{k}": v for k, v in self.model.config.items()}
        facts["model.dtype"] = self.model.dtype
        facts["decode.speculation_length"] = self.decode.speculation_length
        if self.parallel != ParallelInfo():
            facts["parallel.tensor_parallel_size"] = self.parallel.tensor_parallel_size
        if self.lora is not None:
            facts |= {f"lora.{k}": v for k, v in asdict(self.lora).items()}
        return facts

    def files(self) -> list[tuple[str, str, str]]:
        """(relative path, sha256, what) of every file the manifest vouches for."""
        assert self.weights is not None
        entries = [(self.weights.file, self.weights.sha256, "weights")]
        if self.text:
            entries += [(rel, digest, "tokenizer") for rel, digest in self.text.files.items()]
        entries += [(lib.file, lib.sha256, f"kernel library {name}") for name, lib in self.libraries.items()]
        ok = [p for p in self.pieces.values() if p.status == "ok" and p.sha256]
        return entries + [(p.file, p.sha256, p.name) for p in ok]


def read_manifest(directory: Path) -> Manifest:
    return Manifest.from_dict(read_manifest_dict(directory), str(Path(directory) / MANIFEST))


def read_manifest_dict(directory: Path, name: str = MANIFEST) -> dict[str, Any]:
    """The validated JSON document itself (for tools that edit or print it whole); ``name``: another
    manifest version's file (``manifest_versions.py``)."""
    path = Path(directory) / name
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        what = "is not an artifact directory" if name == MANIFEST else "has no such manifest version"
        raise ManifestError(f"{directory} {what}: {name} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # truncated, or bytes damaged
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # a directory, unreadable
        raise ManifestError(f"{path}: cannot read it ({e.strerror or e})") from None
    return validate(data, str(path))


def write_manifest(directory: Path, manifest: Manifest) -> None:
    doc = validate(manifest.to_dict())
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    atomic_write(Path(directory) / MANIFEST, lambda p: p.write_text(text))
