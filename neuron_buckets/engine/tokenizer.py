"""Text to ids and back, with the tokenizer ``nb compile`` copied into the artifact.

The files are the model directory's own (``tokenizer.json``, ``tokenizer_config.json``, a chat
template, ...), read by transformers' ``AutoTokenizer`` from the artifact's ``tokenizer/``
folder only, never from a hub, after their sha256 is checked against the manifest: the
tokenizer is what the model was trained with, so encoding, special tokens and the chat template
behave as they do in transformers. transformers is imported only here, on first use (it is the
``text`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from neuron_buckets.artifact.manifest import TOKENIZER, Manifest, ManifestError, read_manifest
from neuron_buckets.utils.errors import UserError
from neuron_buckets.utils.files import intact
from neuron_buckets.utils.owner_only import check_owner_only


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def open(cls, directory: str | Path, manifest: Manifest | None = None) -> Tokenizer | None:
        """The artifact's tokenizer (as its ``manifest`` says, if read already), or None when its
        model directory had none."""
        directory = Path(directory)
        text = (manifest or read_manifest(directory)).text
        if text is None or not text.has_tokenizer:
            return None
        for rel, digest in text.files.items():
            path = directory / rel
            if not intact(path, digest):
                raise ManifestError(f"tokenizer file {path} is missing or does not match its sha256")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UserError(
                "reading text needs transformers: pip install 'neuron-buckets[text]' (or pass token ids)"
            ) from None
        folder = directory / TOKENIZER
        check_owner_only(folder, "tokenizer folder")
        try:
            return cls(AutoTokenizer.from_pretrained(folder, local_files_only=True))
        except Exception as e:  # transformers' errors (JSON, Rust, sentencepiece) name no file
            files = ", ".join(sorted(Path(rel).name for rel in text.files))
            why = " ".join(str(e).split()) or type(e).__name__
            raise UserError(f"{folder}: transformers cannot read the tokenizer ({files}): {why}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, with the special tokens (a BOS) the tokenizer adds to a prompt
        unless ``add_special_tokens`` is false."""
        return self.hf.encode(unicode_text(text, "prompt"), add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens (BOS, EOS, padding) are not text and are skipped."""
        return self.hf.decode(list(ids), skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self, messages: list[dict], add_special_tokens: bool = False, tools: list[dict] | None = None
    ) -> list[int]:
        """The prompt ids of a conversation, ready for the assistant's turn; ``tools`` (OpenAI's
        function definitions) are the template's to write.

        The template writes its own special tokens (a BOS among them), so the rendered text is
        encoded without adding more unless ``add_special_tokens`` asks for them.
        """
        if not self.has_chat_template:
            raise UserError("this model's tokenizer has no chat template; send plain prompts instead")
        for i, m in enumerate(messages):
            for field, value in m.items():
                if isinstance(value, str):
                    unicode_text(value, f"messages[{i}].{field}")
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            text = self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except (TemplateError, OverflowError) as e:  # roles out of order, the sandbox's refusals
            raise UserError(f"the chat template refused these messages: {e}") from None
        return self.hf.encode(text, add_special_tokens=add_special_tokens)


def unicode_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode; a JSON string may hold a lone surrogate (``"\\ud800"``),
    which no tokenizer can encode: a UserError naming ``what`` and where, not a tokenizer crash."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{what} is not valid Unicode: a lone surrogate at character {e.start}") from None
    return text
