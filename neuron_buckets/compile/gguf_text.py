"""A GGUF file's text side: its tokenizer and chat template as files, and its stop ids.

GGUF keeps the tokenizer in metadata (``tokenizer.ggml.*``: tokens, merges, special ids, the chat
template). transformers converts that into a fast tokenizer (``from_pretrained(dir,
gguf_file=...)``, the conversion it loads GGUF models with), so the artifact gets the files
``save_pretrained`` writes (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``)
and serves them like a directory's. The end-of-sequence ids are the metadata's ``eos`` and, as
llama.cpp stops on it too, ``eot`` (end of turn).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from neuron_buckets.model.gguf_checkpoint import GGUFError, reader

STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")


def gguf_text_files(path: Path) -> dict[str, bytes]:
    """The tokenizer files transformers writes for the file's tokenizer, by file name."""
    path = Path(path)
    try:
        from transformers import AutoTokenizer
    except ModuleNotFoundError:
        raise GGUFError(f"{path}: reading a GGUF tokenizer needs transformers: "
                        "pip install 'neuron-buckets[gguf]'") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise GGUFError(f"{path}: transformers cannot read its tokenizer ({type(e).__name__}: {e})") from None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def gguf_eos_token_ids(path: Path, vocab_size: int) -> list[int]:
    """The metadata's end-of-sequence and end-of-turn ids, each checked against the vocabulary."""
    fields = reader(path).fields
    ids = []
    for key in STOP_KEYS:
        if key not in fields:
            continue
        value = fields[key].contents()
        if type(value) is not int or not 0 <= value < vocab_size:
            raise GGUFError(f"{path}: {key} must be a token id in [0, {vocab_size}), got {value!r}")
        ids.append(value)
    return list(dict.fromkeys(ids))
