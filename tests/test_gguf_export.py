"""The bench's bfloat16 GGUF export (``bench/gguf_export.py``), read back by nb's GGUF reader (itself
checked against transformers' in ``test_gguf.py``): the same tensors bit for bit, llama.cpp's q/k
layout undone, and the word tokenizer's ids and merges in llama.cpp's ``gpt2`` form."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file

from bench.gguf_export import write_bf16_gguf
from bench.real_models import Shape, build_checkpoint
from neuron_buckets.model.gguf_checkpoint import check_gguf, read_gguf_state_dict

TINY = Shape("tiny llama", "llama", 2, {
    "vocab_size": 400, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True, "initializer_range": 0.02})


def test_the_export_reads_back_to_the_checkpoints_bfloat16_tensors_and_tokenizer(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "m", TINY, dtype="bfloat16", tokenizer=True)
    path = write_bf16_gguf(model, tmp_path / "m.gguf")
    config = check_gguf(path)
    assert (config.model_type, config.num_layers, config.num_heads, config.num_kv_heads) == ("llama", 2, 4, 2)
    ours = read_gguf_state_dict(path, config, torch.bfloat16)
    stored = load_file(model / "model.safetensors")
    equal = [n for n in stored if torch.equal(ours[n], stored[n])]
    assert len(equal) == len(stored) == 3 + 9 * 2 - 1, set(stored) ^ set(equal)  # tied: no lm_head
    fields = gguf.GGUFReader(path).fields
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 400 and fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert len(fields["tokenizer.ggml.merges"].data) == 400 - 257  # one merge per word token
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {k for n, k in kinds.items() if "norm" not in n} == {"BF16"}
    assert {k for n, k in kinds.items() if "norm" in n} == {"F32"}  # llama.cpp's CPU ops want them so
    assert write_bf16_gguf(model, path) == path  # kept, not rewritten
