"""Text in, text out: a model directory with its tokenizer, compiled, then ``nb generate --prompt``.

The model is a random tiny Llama whose vocabulary is a small byte-level BPE tokenizer's, both
saved by transformers. Its end-of-sequence id is set (in generation_config.json only) to a token
that greedy decoding of "hello world" reaches at a known step, found with transformers itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import ManifestError, read_manifest
from neuron_buckets.cli import app
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.runtime.verify import file_problems
from neuron_buckets.utils.files import sha256_file
from tests.conftest import TEXT_EAGER, TEXT_MAX_NEW, TEXT_PROMPT, error_line, tiny_tokenizer, write_config

PROMPT, MAX_NEW, EAGER = TEXT_PROMPT, TEXT_MAX_NEW, TEXT_EAGER


def nb(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_compile_copies_the_tokenizer_and_records_the_eos_id(text_model, text_artifact):
    model, greedy, k = text_model
    text = read_manifest(text_artifact).text
    names = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}
    assert set(text.files) == {f"tokenizer/{n}" for n in names}
    for rel, digest in text.files.items():
        assert sha256_file(text_artifact / rel) == digest == sha256_file(model / Path(rel).name)
    assert json.loads((model / "config.json").read_text())["eos_token_id"] == 1
    assert text.eos_token_ids == [greedy[k]]  # generation_config.json wins over config.json


def test_generate_prints_the_text_transformers_decodes_and_stops_at_eos(text_model, text_artifact):
    from transformers import AutoTokenizer

    model, greedy, k = text_model
    result = nb("generate", text_artifact, "--prompt", PROMPT, "--max-new-tokens", MAX_NEW)
    assert result.exit_code == 0, result.output
    expected = AutoTokenizer.from_pretrained(model).decode(greedy[:k], skip_special_tokens=True)
    assert result.stdout == expected + "\n"
    assert f"[request 0: {k + 1} tokens, stop: end-of-sequence token {greedy[k]}]" in result.stderr


def test_a_stop_string_cuts_the_text_where_it_begins(text_model, text_artifact):
    from transformers import AutoTokenizer

    model, greedy, _ = text_model
    full = AutoTokenizer.from_pretrained(model).decode(greedy, skip_special_tokens=True)
    stop = full[len(full) // 2 :][:2]
    args = ["--prompt", PROMPT, "--max-new-tokens", MAX_NEW, "--ignore-eos", "--stop", stop]
    result = nb("generate", text_artifact, *args)
    assert result.exit_code == 0, result.output
    assert result.stdout == full[: full.index(stop)] + "\n"
    assert f"stop: stop string {stop!r}" in result.stderr
    within = nb("generate", text_artifact, *args, "--min-new-tokens", MAX_NEW)  # no stop string is looked for
    assert within.exit_code == 0, within.output
    assert within.stdout == full + "\n" and "length: max-new-tokens" in within.stderr
    over = nb("generate", text_artifact, *args, "--min-new-tokens", MAX_NEW + 1)
    assert over.exit_code != 0
    assert f"min_tokens must be an integer in [0, max_tokens={MAX_NEW}]" in over.output


def test_chat_applies_the_models_template(text_artifact):
    tokenizer = Tokenizer.open(text_artifact)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == tokenizer.hf.encode("<s>user: hi\nassistant:", add_special_tokens=False)
    assert ids.count(0) == 1  # the template's BOS, none added on top
    result = nb("generate", text_artifact, "--prompt", "hi", "--chat", "--max-new-tokens", 3, "--ignore-eos")
    assert result.exit_code == 0, result.output
    assert "[request 0: 3 tokens, length: max-new-tokens 3 reached]" in result.stderr


def test_a_recompile_removes_only_the_tokenizer_files_it_wrote(text_model, text_artifact, tmp_path):
    model = Path(shutil.copytree(text_model[0], tmp_path / "model"))
    out = Path(shutil.copytree(text_artifact, tmp_path / "art"))
    (model / "chat_template.jinja").unlink()
    (out / "tokenizer" / "notes.txt").write_text("mine")
    config = write_config(tmp_path, model, EAGER)
    assert nb("compile", config, "--out", out, "--cache-dir", tmp_path / "c").exit_code == 0
    assert "tokenizer/chat_template.jinja" not in read_manifest(out).text.files
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == [
        "generation_config.json", "notes.txt", "tokenizer.json", "tokenizer_config.json"
    ]
    assert not Tokenizer.open(out).has_chat_template
    line = error_line(nb("generate", out, "--prompt", "hi", "--chat"))
    assert "has no chat template" in line


def test_a_tampered_tokenizer_file_is_refused(text_artifact, tmp_path):
    out = Path(shutil.copytree(text_artifact, tmp_path / "art"))
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    assert "tokenizer file tokenizer/tokenizer.json does not match its sha256" in file_problems(out)
    with pytest.raises(ManifestError, match="tokenizer.json is missing or does not match its sha256"):
        Tokenizer.open(out)


def test_an_eos_id_outside_the_vocabulary_is_refused_before_anything_compiles(text_model, tmp_path):
    model = Path(shutil.copytree(text_model[0], tmp_path / "model"))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 100000]}))
    config = write_config(tmp_path, model, EAGER)
    line = error_line(nb("compile", config, "--out", tmp_path / "art", "--cache-dir", tmp_path / "c"))
    vocab = len(tiny_tokenizer())
    assert f"{model / 'generation_config.json'}: eos_token_id must be a token id or a list of them" in line
    assert f"in [0, {vocab}); got [5, 100000]" in line and not (tmp_path / "art").exists()


def copy_with_tokenizer_file(text_artifact: Path, tmp_path: Path, name: str, edit) -> Path:
    """The artifact with one tokenizer file rewritten and its sha256 recorded, as if compiled so."""
    out = Path(shutil.copytree(text_artifact, tmp_path / "art", ignore=shutil.ignore_patterns(".nb-lock*")))
    path = out / "tokenizer" / name
    path.write_text(edit(path.read_text()))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["text"]["files"][f"tokenizer/{name}"] = sha256_file(path)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_a_garbage_tokenizer_json_is_an_error_naming_the_file(text_artifact, tmp_path):
    """Probe 10: transformers' own error named no file."""
    out = copy_with_tokenizer_file(text_artifact, tmp_path, "tokenizer.json", lambda _: "not json {")
    line = error_line(nb("generate", out, "--prompt", PROMPT))
    assert f"{out / 'tokenizer'}: transformers cannot read the tokenizer" in line and "tokenizer.json" in line


def test_a_prompt_that_is_not_valid_unicode_is_one_error_line(text_artifact):
    """Probe 7: invalid UTF-8 in argv arrives as lone surrogates (Python's surrogateescape)."""
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    line = error_line(nb("generate", text_artifact, "--prompt", prompt))
    assert "prompt is not valid Unicode: a lone surrogate at character 3" in line


def test_a_chat_template_that_refuses_is_one_error_line(text_artifact, tmp_path):
    """Probe 9: nb serve answered 400, nb generate --chat printed a traceback."""
    refusing = "{{ raise_exception('roles must alternate') }}"
    out = copy_with_tokenizer_file(text_artifact, tmp_path, "chat_template.jinja", lambda _: refusing)
    line = error_line(nb("generate", out, "--prompt", PROMPT, "--chat"))
    assert "the chat template refused these messages: roles must alternate" in line
