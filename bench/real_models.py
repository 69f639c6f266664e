"""Random-weight Hugging Face checkpoints of real model shapes, for benchmarks against peer engines.

The weights are random (no download, no licence question) but the shapes, dtype and config keys are
those of the real model, so every engine does the real amount of work and loads the directory through
its ordinary Hugging Face path. Both peers read the same directory, so their greedy outputs can be
compared token for token.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "nb-bench-model.json"

SMOLLM2_135M: dict[str, object] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def word_tokenizer(vocab_size: int = int(SMOLLM2_135M["vocab_size"])):
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids whose text is words, not bytes.

    The real SmolLM2 tokenizer cannot be downloaded here, and servers under test need one: clients
    send text, and the server encodes it and detokenizes every generated id. Id 0 is
    ``<|endoftext|>`` (SmolLM2's BOS and EOS, not added to prompts), then the 256 byte symbols, then
    space-prefixed lowercase words of 1 to 4 letters. Every multi-byte token starts a word, so
    random ids decode to text that encodes back to about as many ids (300 give 300 to 302): load
    generators that build prompts from random ids (vLLM's ``random`` dataset) get the lengths they
    ask for.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0}
    vocab.update((ch, i + 1) for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())))
    merges: list[tuple[str, str]] = []
    words = ["\u0120"]  # the byte-level symbol of a space: words grow one letter at a time from it
    while len(vocab) < vocab_size:
        longer = (w + ch for w in words for ch in string.ascii_lowercase)
        words = list(itertools.islice(longer, vocab_size - len(vocab)))
        merges += [(w[:-1], w[-1]) for w in words]
        vocab.update({w: i for i, w in enumerate(words, start=len(vocab))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


LLAMA_3_2_1B: dict[str, object] = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}

QWEN3_1_7B: dict[str, object] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
}


@dataclass(frozen=True)
class Shape:
    """A real model's config: its transformers ``model_type``, layer count and other fields."""

    name: str
    model_type: str
    num_layers: int
    fields: dict[str, object]

    def get(self, key: str) -> int:
        return int(self.fields[key])  # type: ignore[call-overload]

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V that one token writes in every layer (times the dtype's bytes)."""
        return 2 * self.num_layers * self.get("num_key_value_heads") * self.get("head_dim")


SHAPES = {
    "smollm2-135m": Shape("SmolLM2-135M", "llama", 30, {
        **{k: v for k, v in SMOLLM2_135M.items() if k != "rope_theta"},
        "rope_parameters": {"rope_type": "default", "rope_theta": SMOLLM2_135M["rope_theta"]}}),
    "llama-3.2-1b": Shape("Llama-3.2-1B", "llama", 16, LLAMA_3_2_1B),
    "qwen3-1.7b": Shape("Qwen3-1.7B", "qwen3", 28, QWEN3_1_7B),
}


def build_checkpoint(
    out_dir: Path, shape: Shape, num_layers: int | None = None, seed: int = 0, dtype: str = "float32",
    tokenizer: bool = False,
) -> Path:
    """Write (or reuse) a random-weight checkpoint of ``shape``, stored in ``dtype``.

    A marker file records the shape and seed and is written last, so a directory left half-written by
    an interrupted run is rebuilt instead of silently reused. ``num_layers`` makes a shallow twin of the
    same width (e.g. 2 layers) for quick runs. ``tokenizer`` adds ``word_tokenizer``'s files, for
    servers that take text; its id 0 is then the BOS and EOS id of every shape. Engines cast the
    weights to the dtype they serve, so one bfloat16 checkpoint (as the real ones ship) serves a
    float32 run too.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    layers = num_layers or shape.num_layers
    spec = {"shape": shape.name, "num_layers": layers, "seed": seed, "dtype": dtype}
    if tokenizer:
        spec["tokenizer"] = "word_tokenizer"
    marker = out_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)

    fields = {**shape.fields, "bos_token_id": 0, "eos_token_id": 0}
    config = AutoConfig.for_model(shape.model_type, **fields, num_hidden_layers=layers, dtype=dtype)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer:
        word_tokenizer(config.vocab_size).save_pretrained(out_dir)
    marker.write_text(json.dumps(spec))
    return out_dir


def build_smollm(out_dir: Path, num_layers: int = 30, seed: int = 0, tokenizer: bool = False) -> Path:
    """A random-weight SmolLM2-135M-shaped Llama checkpoint in float32 (``build_checkpoint``)."""
    return build_checkpoint(out_dir, SHAPES["smollm2-135m"], num_layers, seed, "float32", tokenizer)


def add_size_args(parser: argparse.ArgumentParser, work: str, tiny: str) -> None:
    """The arguments every real-scale bench takes: where its models and its ``work`` folder (under
    the temporary directory, or ``$NB_BENCH_MODELS`` and ``$NB_BENCH_WORK``) are, the layer count,
    and ``--tiny`` (2 layers and less work: ``tiny`` says what else it shrinks)."""
    tmp, env = Path(tempfile.gettempdir()), os.environ.get
    parser.add_argument("--models", type=Path, default=Path(env("NB_BENCH_MODELS", tmp / "nb-bench-models")),
                        help="random-weight model directories (default: $NB_BENCH_MODELS)")
    parser.add_argument("--work", type=Path, default=Path(env("NB_BENCH_WORK", tmp / work)),
                        help=f"artifacts, graph cache, logs, results (default: $NB_BENCH_WORK, else {work})")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help=f"2 layers, {tiny}: checks the script only")
