"""What ``nb compile`` builds, before a byte is written: the buckets, the pieces that run each of
them, every piece's key and graph file, and the manifest's header.

Each bucket runs as an embed piece, one decoder-layer piece called once per layer, and a head
piece (``model/pieces.py``); pieces that buckets share appear once. A key hashes everything that
shapes a piece's graph (``cache_key.py``), so equal keys are one graph wherever they were built.
The plan is plain data: the compiler builds it, ``nb compile --dry-run`` prints where each of its
pieces would come from (``compile_plan.py``), and neither reaches into the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from neuron_buckets._version import __version__
from neuron_buckets.artifact.manifest import (
    GRAPHS,
    BackendInfo,
    CacheGeometry,
    DecodeInfo,
    EmbeddingInfo,
    LoraInfo,
    Manifest,
    ModelInfo,
    ParallelInfo,
)
from neuron_buckets.backends import Backend
from neuron_buckets.compile.cache_key import backend_source_digest, graph_key
from neuron_buckets.compile.worker import Toolchain
from neuron_buckets.config import Config, ConfigError, enumerate_grid
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.kernels.libraries import cpu_attention
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.pieces import PieceShape, bucket_pieces
from neuron_buckets.model.tp.tensor_parallel import TensorParallel


def tensor_parallel(config: Config, model: LlamaConfig) -> TensorParallel:
    """The config's tensor-parallel degree, once the model splits over it."""
    tp = TensorParallel(config.parallel.tensor_parallel_size)
    if tp.size > 1 and (problem := tp.check(model)):
        raise ConfigError(f"parallel.tensor_parallel_size: {problem}")
    return tp


def cache_geometry(model: LlamaConfig, config: Config) -> CacheGeometry:
    """The cache one rank allocates: its KV heads only, under tensor parallelism."""
    c = config.cache
    return CacheGeometry(
        block_size=c.block_size,
        num_blocks=c.num_blocks,
        num_layers=model.num_layers,
        num_kv_heads=tensor_parallel(config, model).local(model).num_kv_heads,
        head_dim=model.head_dim,
        dtype=c.dtype,
        max_model_len=c.max_model_len,
    )


def fresh_layers(config: Config) -> bool:
    """Whether packed buckets get a fresh layer: as set, else where the attention's cost follows the
    block table's width (flex). The C++ attention on a CPU reads each segment's context
    alone, so a table of no columns gains it nothing."""
    if config.compile.fresh_layers is not None:
        return config.compile.fresh_layers
    return not cpu_attention(config.compile.device, config.cache.dtype)


def manifest_header(config: Config, model: LlamaConfig, backend: BackendInfo) -> Manifest:
    """The manifest before any file is written: toolchain, backend, model, cache and decode."""
    b, m = config.buckets, config.model
    return Manifest(
        toolchain={"name": "neuron-buckets", "version": __version__},
        backend=backend,
        model=ModelInfo(
            source=str(config.model.path) if config.model.path else "embedded-default",
            config=model.to_hf(),
            dtype=config.cache.dtype,
        ),
        cache=cache_geometry(model, config),
        decode=DecodeInfo(
            speculation_length=b.speculation_length,
            max_num_seqs=b.max_num_seqs,
            max_num_batched_tokens=b.max_num_batched_tokens,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        ),
        parallel=ParallelInfo(config.parallel.tensor_parallel_size),
        lora=LoraInfo(lo.max_loras, lo.max_lora_rank, lo.target_modules) if (lo := config.lora).enabled
        else None,
        embedding=EmbeddingInfo(m.pooling, m.normalize) if m.embeds else None,
    )


@dataclass(frozen=True)
class BuildPlan:
    config: Config
    out: Path
    backend: Backend
    model_config: LlamaConfig
    buckets: list[Bucket]
    bucket_pieces: dict[Bucket, dict[str, PieceShape]]  # role -> piece, per bucket
    keys: dict[PieceShape, str]  # every piece once, in build order
    header: Manifest  # what the manifest says before any piece is built
    toolchain: Toolchain  # what the keys were computed with, checked by every worker
    previous: Manifest | None  # the last run's manifest in ``out``, if any
    draft: BuildPlan | None = None  # the draft model's sub-artifact, when there is one

    @classmethod
    def make(cls, config: Config, out: Path, backend: Backend, model: LlamaConfig,
             previous: Manifest | None) -> BuildPlan:
        buckets = enumerate_grid(config)
        decode_seq = 1 + config.buckets.speculation_length
        fresh = backend.fresh_layers and fresh_layers(config)
        pieces = {b: bucket_pieces(b, backend.dynamic_shapes, decode_seq, fresh, config.model.embeds)
                  for b in buckets}
        shapes = sorted({s for roles in pieces.values() for s in roles.values()})
        info = BackendInfo(backend.name, config.compile.device, backend.versions(),
                           backend.resolved_flags(config.compile.flags))
        header = manifest_header(config, model, info)
        toolchain = Toolchain(backend_source_digest(backend), info.versions)
        keys = {
            s: graph_key(piece=s, model_config=header.model.config, cache=asdict(header.cache),
                         backend=asdict(info), sources=toolchain.sources,
                         tensor_parallel_size=header.parallel.tensor_parallel_size,
                         lora=header.lora and asdict(header.lora))
            for s in shapes
        }
        return cls(config, Path(out), backend, model, buckets, pieces, keys, header, toolchain, previous)

    @property
    def shapes(self) -> list[PieceShape]:
        return list(self.keys)

    @property
    def num_pieces(self) -> int:
        """Pieces this run builds or reuses, the draft's included."""
        return len(self.keys) + (self.draft.num_pieces if self.draft else 0)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets) + (self.draft.num_buckets if self.draft else 0)

    def graph_file(self, key: str) -> Path:
        return self.out / GRAPHS / f"{key}.{self.backend.graph_ext}"
