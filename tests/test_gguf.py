"""GGUF checkpoints read by nb: tiny files written with gguf-py's own writer (``gguf.GGUFWriter``),
read back by nb and by transformers' GGUF loader (the oracle: names, q/k permutation, dequantized
values), and the broken files a user can hand nb, each refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from neuron_buckets.cli import app
from neuron_buckets.model.gguf_checkpoint import check_gguf, read_gguf_state_dict
from tests.conftest import error_line

# A decoder small enough to write in milliseconds: 4 heads of 32 (2 KV heads), rows of 64 that
# every tested quantization's block (32) divides.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 128, 4, 2, 32, 96, 2


def tensor_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of a tiny ``arch`` model by GGUF name, numpy (row-major) shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        b = f"blk.{i}"
        shapes |= {
            f"{b}.attn_norm.weight": (HIDDEN,), f"{b}.ffn_norm.weight": (HIDDEN,),
            f"{b}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{b}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{b}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{b}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{b}.ffn_gate.weight": (INTER, HIDDEN), f"{b}.ffn_up.weight": (INTER, HIDDEN),
            f"{b}.ffn_down.weight": (HIDDEN, INTER),
        }
        if arch == "qwen2":
            shapes |= {f"{b}.attn_q.bias": (HEADS * HEAD_DIM,), f"{b}.attn_k.bias": (KV_HEADS * HEAD_DIM,),
                       f"{b}.attn_v.bias": (KV_HEADS * HEAD_DIM,)}
        if arch == "qwen3":
            shapes |= {f"{b}.attn_q_norm.weight": (HEAD_DIM,), f"{b}.attn_k_norm.weight": (HEAD_DIM,)}
    return shapes


def write_gguf(
    path: Path, arch: str = "llama", qtype: str = "F32", shapes: dict[str, tuple[int, ...]] | None = None,
    raw: dict[str, gguf.GGMLQuantizationType] | None = None, seed: int = 0,
) -> Path:
    """A random tiny ``arch`` model with a byte-level tokenizer's metadata; 2-D weights stored as
    ``qtype`` (quantized by gguf-py), ``raw`` tensors as random bytes of the named type."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_merges([])
    w.add_eos_token_id(1)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, shape in (shapes or tensor_shapes(arch)).items():
        if name in (raw or {}):
            block, size = gguf.GGML_QUANT_SIZES[raw[name]]
            data = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, data, raw_dtype=raw[name])
            continue
        data = rng.normal(0.0, 0.2, shape).astype(np.float32) + (1.0 if name.endswith("norm.weight") else 0.0)
        if len(shape) == 2 and kind != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as transformers' GGUF loader reads them, by transformers name."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(path, return_tensors=False)
    config = transformers.AutoConfig.for_model(**parsed["config"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]


@pytest.mark.parametrize(("arch", "qtype"), [
    ("llama", "F32"), ("llama", "F16"), ("llama", "BF16"), ("llama", "Q8_0"), ("llama", "Q4_0"),
    ("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3", "F32"), ("qwen3", "Q4_1"),
])
def test_tensors_are_transformers_own_reading_of_the_file(tmp_path: Path, arch: str, qtype: str) -> None:
    """Names, llama's q/k permutation undone, and every value dequantized as transformers does."""
    path = write_gguf(tmp_path / "m.gguf", arch, qtype)
    config = check_gguf(path)
    assert (config.model_type, config.num_layers, config.head_dim) == (arch, LAYERS, HEAD_DIM)
    assert config.qkv_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")
    ours = read_gguf_state_dict(path, config, torch.float32)
    theirs = transformers_tensors(path)
    compared = [name for name in ours if torch.equal(ours[name], theirs[name].float())]
    assert len(compared) == len(ours) == len(theirs) >= 3 + 9 * LAYERS, set(ours) ^ set(compared)


def compile_error(tmp_path: Path, gguf_file: Path) -> str:
    """``nb compile``'s one error line for a config naming ``gguf_file``."""
    config = tmp_path / "nb.toml"
    config.write_text(f'[model]\npath = "{gguf_file.as_posix()}"\n')
    args = ["compile", str(config), "--out", str(tmp_path / "art"), "--cache-dir", str(tmp_path / "c")]
    return error_line(CliRunner().invoke(app, args))


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "gpt2", shapes={"output_norm.weight": (8,)})
    line = compile_error(tmp_path, path)
    assert "m.gguf: architecture 'gpt2' is not supported" in line and "qwen3" in line


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert "m.gguf: not a complete GGUF file" in compile_error(tmp_path, path)


def test_a_tensor_of_a_quantization_nb_does_not_read_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", raw={"blk.1.ffn_up.weight": gguf.GGMLQuantizationType.IQ4_NL})
    line = compile_error(tmp_path, path)
    assert "tensor blk.1.ffn_up.weight is of type IQ4_NL, which nb does not read" in line and "Q6_K" in line


def test_a_tensor_of_the_wrong_shape_is_refused_with_both_shapes(tmp_path: Path) -> None:
    shapes = {**tensor_shapes("llama"), "blk.0.attn_k.weight": (HEADS * HEAD_DIM, HIDDEN)}
    line = compile_error(tmp_path, write_gguf(tmp_path / "m.gguf", shapes=shapes))
    assert f"tensor blk.0.attn_k.weight has shape {(HEADS * HEAD_DIM, HIDDEN)}" in line
    assert f"the metadata implies {(KV_HEADS * HEAD_DIM, HIDDEN)}" in line


def test_a_missing_tensor_is_refused_by_name(tmp_path: Path) -> None:
    shapes = {k: v for k, v in tensor_shapes("qwen3").items() if k != "blk.1.attn_k_norm.weight"}
    assert "lacks tensor(s) ['blk.1.attn_k_norm.weight']" in compile_error(
        tmp_path, write_gguf(tmp_path / "m.gguf", "qwen3", shapes=shapes))


def test_the_weights_are_keyed_by_the_files_content(tmp_path: Path) -> None:
    """Two files alike in name, size and modification time but not in bytes key different weights;
    a copy of the same bytes keys the same ones."""
    from neuron_buckets.model.model_source import weights_fingerprint

    for name in "abc":
        (tmp_path / name).mkdir()
    a, b = write_gguf(tmp_path / "a" / "m.gguf", seed=1), write_gguf(tmp_path / "b" / "m.gguf", seed=2)
    copy = tmp_path / "c" / "m.gguf"
    copy.write_bytes(a.read_bytes())
    for path in (a, b, copy):
        os.utime(path, ns=(0, 0))
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    keys = [weights_fingerprint(p, torch.float32) for p in (a, b, copy)]
    assert keys[0] != keys[1] and keys[0] == keys[2]
    assert weights_fingerprint(a, torch.bfloat16) != keys[0]
