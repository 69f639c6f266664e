"""A bench checkpoint (``real_models.py``: a llama-architecture shape, random weights, its byte-level
BPE word tokenizer) as a bfloat16 GGUF that llama.cpp serves, written with gguf-py's own writer.

llama.cpp's converter (``convert_hf_to_gguf.py``, shipped in its source) refuses a tokenizer whose
pre-tokenizer it does not recognise by hash, and the bench's word tokenizer is not one of the
hashed ones; its pre-tokenizer is GPT-2's byte-level split, which gguf-py names ``gpt-2``. So the
file is written here, as that converter writes a llama: gguf-py's tensor-name table, q and k rows
permuted into llama.cpp's rotary layout (the inverse of ``model/gguf_checkpoint.py``'s un-permute),
every matrix in bfloat16 as stored (1-D norms in float32, which holds them exactly, as the
converter writes them: llama.cpp's CPU ops refuse a bfloat16 norm), and the tokenizer as ``gpt2``
tokens and merges. A llama3 rope scaling is not written (its ``rope_freqs``): the peer is timed,
not its tokens compared. nb reads the file back to the same tensors (``tests/test_gguf_export.py``),
and llama-cpp-python's server serves it.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ROPE_THETA = 10000.0  # transformers' default when a config names none


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's layout of q or k rows: each head's rotary halves ``(2, D/2)`` as pairs ``(D/2, 2)``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _bf16(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _tokenizer(w: gguf.GGUFWriter, model_dir: Path) -> None:
    """The checkpoint's ``tokenizer.json`` (byte-level BPE) as llama.cpp's ``gpt2`` tokenizer."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    tokens = [""] * (max([*vocab.values(), *special.values()]) + 1)
    for text, i in {**vocab, **special}.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    kinds = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    eos = special.get("<|endoftext|>", 0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)


def write_bf16_gguf(model_dir: Path, out: Path) -> Path:
    """``model_dir`` (a llama-architecture checkpoint of safetensors) as a bfloat16 GGUF at ``out``;
    kept if already written."""
    if out.is_file():
        return out
    config = json.loads((model_dir / "config.json").read_text())
    if config["model_type"] != "llama":
        raise SystemExit(f"{model_dir}: a {config['model_type']} checkpoint; this export writes llama only")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state |= load_file(shard)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tmp = out.with_suffix(".partial")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_block_count(layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta") or ROPE_THETA))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    _tokenizer(w, model_dir)
    for name, tensor in state.items():
        module, suffix = name.rsplit(".", 1)
        if name.endswith("q_proj.weight"):
            tensor = permute(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = permute(tensor, kv_heads)
        gguf_name = f"{table.get_name(module)}.{suffix}"
        if tensor.dim() == 1:  # norms: llama.cpp's CPU ops take them in float32 only
            w.add_tensor(gguf_name, tensor.float().numpy())
        else:
            w.add_tensor(gguf_name, _bf16(tensor), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out
