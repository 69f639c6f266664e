"""GGUF checkpoints (llama.cpp's one-file format) read directly: config, tensors and their types.

llama.cpp, ollama and LM Studio hold models as one ``.gguf`` file; ``[model] path`` may name one.
gguf-py (``gguf``) reads it, never a parser of ours. The metadata gives the architecture and the
config; llama (Llama, SmolLM2, and Mistral, which llama.cpp converts as llama), qwen2 and qwen3
are the decoders nb computes, anything else is refused by name. Each HF tensor name maps to its
GGUF name through gguf-py's own table (``get_tensor_name_map``), as transformers' GGUF loader maps
them, and llama.cpp's converter's permutation of a llama's q and k rows (its rotary pairs
interleaved) is undone. F32, F16 and BF16 tensors are taken as stored; ``DEQUANTIZED`` types
are dequantized with gguf-py's dequantizer (to float32, then the model's dtype when loaded); any
other type is refused. The tokenizer side is ``compile/gguf_text.py``'s.
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from neuron_buckets.model.checkpoint import checkpoint_shapes
from neuron_buckets.model.model_config import LlamaConfig

if TYPE_CHECKING:  # gguf is imported when a GGUF file is read, so that nb runs without it otherwise
    from gguf import GGUFReader, ReaderTensor

SUFFIX = ".gguf"
# GGUF architecture -> nb's model_type: the decoders whose tensors and metadata map one to one.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
AS_STORED = ("F32", "F16", "BF16")
DEQUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# Tensors llama.cpp keeps beside the weights: a llama 3.1 file's rope_freqs carries its rope
# scaling as a tensor, which nb does not read back into a config, so such a file is refused.
_REFUSED_TENSORS = {"rope_freqs.weight": "Llama 3.1 rope scaling (rope_freqs) is not supported"}


class GGUFError(ValueError):
    """A GGUF file nb cannot read as a model; the message names the file and what is wrong."""


def is_gguf(source: Path | None) -> bool:
    """Whether a model source names a GGUF file (a directory is a Hugging Face checkpoint)."""
    return source is not None and Path(source).suffix == SUFFIX


@cache
def _reader(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    """The file's reader, once per version of the file (it maps the file; reading is lazy)."""
    try:
        import gguf
    except ModuleNotFoundError:
        raise GGUFError(f"{path}: reading a GGUF file needs the gguf package: "
                        "pip install 'neuron-buckets[gguf]'") from None
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: not a complete GGUF file ({type(e).__name__}: {e})") from None


def reader(path: Path) -> GGUFReader:
    """The file's ``gguf.GGUFReader``; a missing, truncated or malformed file is a GGUFError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: [model] path names no GGUF file")
    st = path.stat()
    return _reader(path.resolve(), st.st_mtime_ns, st.st_size)


def metadata(path: Path) -> dict[str, object]:
    """Every metadata key of the file but the tokenizer's long lists, as Python values."""
    fields = reader(path).fields
    return {k: f.contents() for k, f in fields.items() if not k.startswith("tokenizer.ggml.")
            or len(f.data) == 1}


def _architecture(path: Path, meta: dict[str, object]) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; use one of {sorted(ARCHITECTURES)}")
    return str(arch)


def read_gguf_config(path: Path) -> LlamaConfig:
    """The model config the file's metadata describes (``{arch}.*`` keys, as llama.cpp writes them)."""
    path = Path(path)
    meta = metadata(path)
    arch = _architecture(path, meta)
    names = {t.name for t in reader(path).tensors}
    if refused := next((n for n in _REFUSED_TENSORS if n in names), None):
        raise GGUFError(f"{path}: {_REFUSED_TENSORS[refused]}")
    if (scaling := meta.get(f"{arch}.rope.scaling.type", "none")) != "none":
        raise GGUFError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported")

    def key(name: str, default: object = None) -> object:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata lacks {arch}.{name}")
        return value

    tokens = reader(path).fields.get("tokenizer.ggml.tokens")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    try:
        return LlamaConfig(
            vocab_size=int(key("vocab_size", len(tokens.data) if tokens else None)),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(head_dim or hidden // heads),
            max_position_embeddings=int(key("context_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in names,
            model_type=ARCHITECTURES[arch],
            attention_bias=arch != "qwen2" and "blk.0.attn_q.bias" in names,
        )
    except (ValueError, TypeError) as e:
        raise GGUFError(f"{path}: {e}") from None


def _name_map(path: Path, config: LlamaConfig) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, by gguf-py's table of the file's architecture."""
    import gguf

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == _architecture(path, metadata(path)))
    table = gguf.get_tensor_name_map(arch, config.num_layers)
    names = {}
    for hf in checkpoint_shapes(config):
        module, suffix = hf.rsplit(".", 1)
        names[hf] = f"{table.get_name(module)}.{suffix}"
    return names


def _tensors(path: Path, config: LlamaConfig) -> dict[str, ReaderTensor]:
    """The file's tensor records by HF name, each checked: present, of a readable type, of the
    shape the metadata implies; an extra tensor (other than an unused tied ``output``) is refused."""
    by_name = {t.name: t for t in reader(path).tensors}
    names, shapes = _name_map(path, config), checkpoint_shapes(config)
    if missing := sorted(g for g in names.values() if g not in by_name):
        raise GGUFError(f"{path}: lacks tensor(s) {missing} that the metadata implies")
    if unexpected := sorted(set(by_name) - set(names.values())):
        raise GGUFError(f"{path}: unexpected tensor(s) {unexpected} for a {config.model_type} model")
    records = {}
    for hf, name in names.items():
        t = by_name[name]
        kind = t.tensor_type.name
        if kind not in AS_STORED + DEQUANTIZED:
            raise GGUFError(f"{path}: tensor {name} is of type {kind}, which nb does not read; "
                            f"use one of {list(AS_STORED + DEQUANTIZED)}")
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        if shape != shapes[hf]:
            raise GGUFError(f"{path}: tensor {name} has shape {shape}, the metadata implies {shapes[hf]}")
        records[hf] = t
    return records


def check_gguf(path: Path) -> LlamaConfig:
    """The file's config after a look at every tensor's name, type and shape (cheap: nothing is
    dequantized), so a bad file fails before anything is written or compiled."""
    config = read_gguf_config(path)
    _tensors(path, config)
    return config


def dequantization_line(path: Path, dtype: str) -> str | None:
    """What reading the file does to its quantized tensors, in one line (None if it has none)."""
    kinds = Counter(k for t in reader(path).tensors if (k := t.tensor_type.name) in DEQUANTIZED)
    if not kinds:
        return None
    counts = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
    return f"{Path(path).name}: dequantizing {counts} tensor(s) to {dtype} (gguf-py)"


def _unpermute(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's ``permute`` of q or k rows (bias too): it regrouped each head's rotary
    halves ``(2, D/2)`` into interleaved pairs ``(D/2, 2)``; this swaps them back."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _as_tensor(t: ReaderTensor) -> Tensor:
    """One tensor: F32/F16 as numpy maps them, BF16 as its raw bits, any other type dequantized."""
    from gguf import dequantize

    kind = t.tensor_type.name
    shape = tuple(int(n) for n in reversed(t.shape))
    if kind in ("F32", "F16"):
        return torch.from_numpy(np.array(t.data)).reshape(shape)
    if kind == "BF16":
        return torch.from_numpy(np.array(t.data)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(shape)


def read_gguf_state_dict(path: Path, config: LlamaConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """Every tensor by HF name, q and k of a llama unpermuted, each cast to ``dtype`` as it is read
    (so a dequantized float32 copy is held for one tensor at a time)."""
    tensors = {}
    for hf, t in _tensors(path, config).items():
        w = _as_tensor(t)
        if config.model_type == "llama" and ".self_attn.q_proj." in hf:
            w = _unpermute(w, config.num_heads)
        elif config.model_type == "llama" and ".self_attn.k_proj." in hf:
            w = _unpermute(w, config.num_kv_heads)
        tensors[hf] = w.to(dtype)
    return tensors
