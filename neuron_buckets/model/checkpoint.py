"""Weights in and out: Hugging Face style checkpoint directories and the artifact's one file.

A checkpoint directory holds ``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``, with the transformers parameter names (which ``Llama`` uses
itself), in float32, float16 or bfloat16. transformers is never imported: safetensors reads the
tensors. The artifact stores the weights once (``save_weights``) and every bucket graph shares
them (``load_weights``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from neuron_buckets.model.hf_config import parse_hf_config
from neuron_buckets.model.llama import Llama, LlamaConfig

DEFAULT_CONFIG = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)
DEFAULT_SEED = 0
# Large enough that two layers of random weights still give clearly separated logits.
DEFAULT_INIT_STD = 0.1
LOADABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Buffers some older checkpoints stored; recomputed from the config here.
_DERIVED = ".rotary_emb.inv_freq"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as what it claims to be; the message names it."""


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def read_config(path: str | Path) -> LlamaConfig:
    """The model config of a checkpoint directory's ``config.json``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a model directory needs config.json")
    return parse_hf_config(_read_json(file), str(file))


def _inside(directory: Path, name: str) -> bool:
    """Whether ``name`` names a file in ``directory`` (transformers writes plain file names): no
    absolute path, no ``..``, no link that resolves elsewhere, so an index cannot make nb read
    (and copy into an artifact) another file of the machine."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        return False
    return (directory / relative).resolve().is_relative_to(directory.resolve())


def shard_files(path: str | Path) -> list[Path]:
    """The safetensors files of a directory's single or sharded checkpoint."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map object")
        shards = sorted(set(map(str, weight_map.values())))
        if outside := next((s for s in shards if not _inside(path, s)), None):
            raise CheckpointError(f"{index}: shard {outside!r} is not a file name inside {path}")
        return [path / shard for shard in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    raise FileNotFoundError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json (found {found})"
    )


@contextmanager
def _reading(shard: Path) -> Iterator[None]:
    """safetensors' own errors name no file; this one does."""
    try:
        yield
    except SafetensorError as e:
        raise CheckpointError(f"{shard}: not a complete safetensors file ({e})") from None


def check_shards(path: str | Path) -> None:
    """Read every shard's header (cheap), so a truncated or corrupt file fails before any work."""
    for shard in shard_files(path):
        with _reading(shard), safe_open(shard, "pt"):
            pass


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a directory's single or sharded safetensors checkpoint."""
    tensors: dict[str, Tensor] = {}
    for shard in shard_files(path):
        with _reading(shard):
            tensors.update(load_file(shard))
    return tensors


def load_weights(model: Llama, weights: str | Path | dict[str, Tensor], share: bool = False) -> Llama:
    """Load a state dict (or one safetensors file) into ``model`` strictly.

    By default the tensors are copied and cast to the model's dtype; ``share=True`` makes the
    model use them as they are (build it on the ``meta`` device), so several models can share one
    copy. A tied model has no ``lm_head``, so a checkpoint's redundant ``lm_head.weight`` is
    dropped; any other missing, unexpected or misshapen tensor is an error that names it.
    """
    if not isinstance(weights, dict):
        weights = load_file(Path(weights))
    weights = {k: v for k, v in weights.items() if not k.endswith(_DERIVED)}
    if model.lm_head is None:
        weights.pop("lm_head.weight", None)
    bad = sorted(k for k, v in weights.items() if v.dtype not in LOADABLE_DTYPES)
    if bad:
        raise ValueError(f"tensors {bad} have unsupported dtypes; use one of {LOADABLE_DTYPES}")
    expected = model.state_dict()
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, strict=True, assign=share)
    return model


def save_weights(model: Llama, file: str | Path) -> None:
    """Write every parameter once, by its transformers name, into one safetensors file.

    A failed write (a full disk) is an OSError, like every other write nb makes.
    """
    try:
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(file))
    except SafetensorError as e:
        raise OSError(str(e)) from None


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Llama:
    """Build the model of a Hugging Face style directory, weights cast to ``dtype``."""
    model = Llama(read_config(path)).to(dtype)
    return load_weights(model, read_state_dict(path)).eval()


def default_model(dtype: torch.dtype = torch.float32) -> Llama:
    """The embedded default: ``DEFAULT_CONFIG`` with deterministic seeded weights."""
    model = Llama(DEFAULT_CONFIG)
    gen = torch.Generator().manual_seed(DEFAULT_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, DEFAULT_INIT_STD, generator=gen)
    return model.to(dtype).eval()


def model_config_of(source: Path | None) -> LlamaConfig:
    """The config of a checkpoint directory or the default, after a look at every shard's header
    (cheap: no tensors read), so a bad checkpoint fails before anything is written or started."""
    if source is None:
        return DEFAULT_CONFIG
    config = read_config(source)
    check_shards(source)
    return config


def build_model(source: Path | None, dtype: torch.dtype) -> Llama:
    """The model of a checkpoint directory, or the embedded default for ``None``."""
    return default_model(dtype) if source is None else load_model(source, dtype)


def weights_fingerprint(source: Path | None, dtype: torch.dtype) -> str:
    """A cheap identity of the weights a source yields, to skip rewriting unchanged weights.

    Checkpoint directories: the names, sizes and modification times of their files; the default:
    this module's source (seed, init) and the torch version (its random generator).
    """
    h = hashlib.sha256(str(dtype).encode())
    if source is None:
        h.update(Path(__file__).read_bytes())
        h.update(torch.__version__.encode())
    else:
        for f in sorted(Path(source).glob("*")):
            if f.suffix in (".safetensors", ".json"):
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()
