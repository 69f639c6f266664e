"""The model directory's text side, carried into the artifact: its tokenizer and its stop ids.

An artifact must serve text without the model directory it came from, so ``nb compile`` copies
the tokenizer files it finds (``tokenizer.json``, ``tokenizer_config.json``, a chat template,
...) and ``generation_config.json`` into ``tokenizer/``, and records in the manifest each file's
sha256 and the end-of-sequence ids: ``generation_config.json``'s ``eos_token_id`` (one id or a
list), else ``config.json``'s. Both are read, and a bad one refused, before anything compiles.
A GGUF file carries its tokenizer in its metadata: ``gguf_text.py`` writes it out as such files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from neuron_buckets.artifact.manifest import TOKENIZER, TextInfo
from neuron_buckets.compile.gguf_text import gguf_eos_token_ids, gguf_text_files
from neuron_buckets.model.gguf_checkpoint import is_gguf
from neuron_buckets.utils.files import atomic_write, intact

TEXT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
EOS_SOURCES = ("generation_config.json", "config.json")


class TextFileError(ValueError):
    """A model directory's text file that cannot be read as what it claims; the message names it."""


def eos_token_ids(source: Path | None, vocab_size: int) -> list[int]:
    """The model's end-of-sequence ids: the first of ``EOS_SOURCES`` that sets ``eos_token_id``
    (a GGUF file's: its metadata's)."""
    if is_gguf(source):
        return gguf_eos_token_ids(source, vocab_size)
    for name in EOS_SOURCES if source is not None else ():
        file = Path(source) / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TextFileError(f"{file}: not valid JSON ({e})") from None
        value = raw.get("eos_token_id") if isinstance(raw, dict) else None
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not ids or any(type(i) is not int or not 0 <= i < vocab_size for i in ids):
            raise TextFileError(
                f"{file}: eos_token_id must be a token id or a list of them, in [0, {vocab_size}); "
                f"got {value!r}"
            )
        return list(dict.fromkeys(ids))
    return []


def text_sources(source: Path | None) -> dict[str, bytes]:
    """The text files of a model, by file name: a directory's own, those a GGUF file's metadata
    makes, none for the embedded default model."""
    if source is None:
        return {}
    if is_gguf(source):
        return gguf_text_files(source)
    return {name: p.read_bytes() for name in TEXT_FILES if (p := Path(source) / name).is_file()}


def write_text_files(sources: dict[str, bytes], out: Path, eos: list[int]) -> TextInfo:
    """Write ``sources`` into ``out/tokenizer/`` (atomic, skipping a copy already intact)."""
    files = {}
    for name, data in sources.items():
        digest = hashlib.sha256(data).hexdigest()
        rel = f"{TOKENIZER}/{name}"
        dest = out / rel
        if not intact(dest, digest, links=False):
            atomic_write(dest, lambda p, data=data: p.write_bytes(data))
        files[rel] = digest
    return TextInfo(eos, files)
