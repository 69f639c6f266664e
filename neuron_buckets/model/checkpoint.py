"""Weights in and out: Hugging Face style checkpoint directories and the artifact's one file.

A checkpoint directory holds ``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``, with the transformers parameter names, in float32, float16 or
bfloat16. transformers is never imported: safetensors reads the tensors. Their names are
``checkpoint_names.py``'s (``LAYER_PARTS``): loading turns them into the fused ``ModelWeights``
the model computes with, saving turns them back. The artifact stores the weights once, by the same names
(``save_weights``), and every bucket graph shares them (``load_weights``). A quantized checkpoint
(compressed-tensors) stores each decoder projection as its quantized ``weight`` and a
``weight_scale`` (and an ``input_scale`` where its activations are quantized statically); the
artifact keeps them so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from neuron_buckets.model.checkpoint_names import LAYER_PARTS, SCALE
from neuron_buckets.model.llama import Llama
from neuron_buckets.model.model_config import LlamaConfig, parse_hf_config
from neuron_buckets.model.quant.quantized_weight import QuantizedWeight
from neuron_buckets.model.weights import PROJECTIONS, LayerWeights, ModelWeights, part_shapes

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
ALIGNMENT = 64  # bytes: what torch's CPU allocator gives every tensor it allocates
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


def checkpoint_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, by transformers name, with its shape."""
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        for field, parts in part_shapes(c).items():
            shapes.update(zip((f"model.layers.{i}.{n}" for n in LAYER_PARTS[field]), parts, strict=True))
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def scale_names(config: LlamaConfig) -> dict[str, int]:
    """A quantized checkpoint's scale tensors by name, each with its weight's output channels
    (a scale holds one per channel, or one for the whole tensor; an input scale one)."""
    scheme = config.quantization
    if scheme is None:
        return {}
    quantized = [name for name in checkpoint_shapes(config) if _quantized(name)]
    scales = {f"{name}{SCALE}": checkpoint_shapes(config)[name][0] for name in quantized}
    if scheme.static_input:
        scales.update({input_scale_name(name): 1 for name in quantized})
    return scales


def input_scale_name(weight: str) -> str:
    """``<module>.input_scale`` of ``<module>.weight``, as compressed-tensors names it."""
    return f"{weight.removesuffix('.weight')}.input_scale"


def _quantized(name: str) -> bool:
    """Whether a checkpoint tensor is a decoder projection's weight (quantized, when the model is)."""
    return any(name.endswith(f".{n}") for f in PROJECTIONS for n in LAYER_PARTS[f] if n.endswith(".weight"))


def load_weights(
    config: LlamaConfig, tensors: str | Path | dict[str, Tensor], dtype: torch.dtype | None = None,
    pack: Callable[[LayerWeights], LayerWeights] | None = None,
) -> ModelWeights:
    """The model's weights from a state dict (or one safetensors file) by transformers name.

    Checked strictly: a tied model has no ``lm_head``, so a checkpoint's redundant
    ``lm_head.weight`` is dropped; any other missing, unexpected or misshapen tensor is an error
    that names it. Cast to ``dtype`` if given, but for a quantized model's projections, which
    stay as stored, their scales float32 per output channel. A tensor that fuses nothing is used as it is, not
    copied, unless it is not ``ALIGNMENT``-aligned (safetensors' are not): CPU BLAS picks its
    kernels by alignment, so an unaligned weight rounds differently, and a model read back from
    its file would not compute what the model that wrote it did. The tensors are taken out of
    ``tensors`` as each layer is fused, so a checkpoint's layers are never held twice; ``pack``
    (a backend's weight layout) is applied to each layer as it is built, for the same reason.
    """
    if not isinstance(tensors, dict):
        tensors = load_file(Path(tensors))
    for key in [k for k in tensors if k.endswith(_DERIVED)]:
        del tensors[key]
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    scheme, scales = config.quantization, scale_names(config)
    stored = getattr(torch, scheme.weights) if scheme else None
    bad = sorted(k for k, v in tensors.items() if v.dtype not in LOADABLE_DTYPES
                 and not (k in scales or (scheme and _quantized(k) and v.dtype == stored)))
    if bad:
        raise ValueError(f"tensors {bad} have unsupported dtypes; use one of {LOADABLE_DTYPES}"
                         + (f" ({stored} for the quantized projections)" if scheme else ""))
    expected = checkpoint_shapes(config)
    missing = sorted((expected.keys() | scales.keys()) - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys() - scales.keys())
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}, the config implies {shape}")
        if scheme and _quantized(name) and tensors[name].dtype != stored:
            raise ValueError(f"{name} is {tensors[name].dtype}, the quantization scheme stores {stored}")
    for name, rows in scales.items():
        if tensors[name].numel() not in (1, rows):
            raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}: need one scale per output "
                             f"channel ({rows}) or one for the tensor")

    def take(name: str) -> Tensor:
        tensor = tensors.pop(name)
        tensor = tensor if dtype is None else tensor.to(dtype)
        return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()

    def take_quantized(name: str) -> QuantizedWeight:
        data, scale = tensors.pop(name), tensors.pop(f"{name}{SCALE}").float().reshape(-1)
        data = data if data.data_ptr() % ALIGNMENT == 0 else data.clone()
        inputs = tensors.pop(input_scale_name(name)).float().reshape(1) if scheme.static_input else None
        return QuantizedWeight(data, scale.expand(data.shape[0]).contiguous(), scheme, inputs)

    def layer(i: int) -> LayerWeights:
        fused = {}
        for field in part_shapes(config):
            names = [f"model.layers.{i}.{n}" for n in LAYER_PARTS[field]]
            if scheme and field in PROJECTIONS:
                fused[field] = QuantizedWeight.fuse([take_quantized(n) for n in names])
                continue
            parts = [take(n) for n in names]
            fused[field] = parts[0] if len(parts) == 1 else torch.cat(parts)
        built = LayerWeights(**fused)
        return built if pack is None else pack(built)

    embed = take("model.embed_tokens.weight")
    layers = tuple(layer(i) for i in range(config.num_layers))
    lm_head = None if config.tie_word_embeddings else take("lm_head.weight")
    return ModelWeights(embed, layers, take("model.norm.weight"), lm_head)


def checkpoint_tensors(config: LlamaConfig, weights: ModelWeights) -> dict[str, Tensor]:
    """``weights`` by transformers name, fused tensors split back into views of themselves."""
    out = {"model.embed_tokens.weight": weights.embed}
    for i, layer in enumerate(weights.layers):
        for field, parts in part_shapes(config).items():
            names = [f"model.layers.{i}.{n}" for n in LAYER_PARTS[field]]
            for name, piece in zip(names, getattr(layer, field).split([p[0] for p in parts]), strict=True):
                if isinstance(piece, QuantizedWeight):
                    out[name], out[f"{name}{SCALE}"] = piece.data, piece.scale
                    if piece.input_scale is not None:
                        out[input_scale_name(name)] = piece.input_scale.clone()  # parts share it
                else:
                    out[name] = piece
    out["model.norm.weight"] = weights.norm
    if weights.lm_head is not None:
        out["lm_head.weight"] = weights.lm_head
    return out


def save_weights(model: Llama, file: str | Path) -> None:
    """Write every weight once, by its transformers name, into one safetensors file.

    A failed write (a full disk) is an OSError, like every other write nb makes.
    """
    tensors = checkpoint_tensors(model.config, model.weights)
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(file))
    except SafetensorError as e:
        raise OSError(str(e)) from None


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Llama:
    """Build the model of a Hugging Face style directory, weights cast to ``dtype``."""
    config = read_config(path)
    tensors = read_state_dict(path)
    if config.quantization is not None:
        from neuron_buckets.model.quant.compressed_tensors_format import unpack

        unpack(tensors)
    return Llama(config, load_weights(config, tensors, dtype))


def default_model(dtype: torch.dtype = torch.float32) -> Llama:
    """The embedded default: ``DEFAULT_CONFIG`` with deterministic seeded weights."""
    gen = torch.Generator().manual_seed(DEFAULT_SEED)
    tensors = {}
    for name, shape in checkpoint_shapes(DEFAULT_CONFIG).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.empty(shape).normal_(0.0, DEFAULT_INIT_STD, generator=gen)
    return Llama(DEFAULT_CONFIG, load_weights(DEFAULT_CONFIG, tensors, dtype))
