"""The CLI's one error path: every expected failure is one plain ``error:`` line and exit status 2;
anything else keeps its traceback and asks for a bug report."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import Manifest
from neuron_buckets.cli import app
from tests.conftest import TINY_CONFIG, error_line, write_config

runner = CliRunner()


def nb(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def test_brackets_in_a_message_are_printed_as_is_not_parsed_as_markup(tmp_path: Path):
    line = error_line(nb("generate", tmp_path, "--prompt-ids", "[/a]"))
    assert "'[/a]'" in line


def test_a_config_error_keeps_the_section_name_in_brackets(tmp_path: Path):
    config = tmp_path / "x.toml"
    config.write_text("[cache]\nblock_sise = 16\n")
    line = error_line(nb("grid", config))
    assert f"{config}: [cache] unknown key(s) ['block_sise']" in line


def test_a_long_message_stays_on_one_line(tmp_path: Path):
    config = tmp_path / ("deep-" * 30) / "x.toml"
    assert str(config) in error_line(nb("grid", config))


def test_an_unexpected_exception_keeps_its_traceback_and_asks_for_a_bug_report(monkeypatch):
    def broken(config):
        raise KeyError("vocab")

    monkeypatch.setattr("neuron_buckets.cli.main.enumerate_grid", broken)
    result = nb("grid")
    assert result.exit_code == 1
    assert "Traceback" in result.output and "KeyError: 'vocab'" in result.output
    assert result.output.splitlines()[-1].startswith("error: unexpected KeyError: this is a bug in nb")


def model_copy(hf_model_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the tiny checkpoint and an eager config compiling it."""
    model = Path(shutil.copytree(hf_model_dir, tmp_path / "model"))
    return model, write_config(tmp_path, model, TINY_CONFIG.replace('"inductor"', '"eager"'))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: json.dumps([c]), "expected a JSON object of settings, got a list"),
        (lambda c: json.dumps({k: v for k, v in c.items() if k != "vocab_size"}), "lacks 'vocab_size'"),
        (lambda c: json.dumps({**c, "vocab_size": "256"}), "vocab_size must be a positive integer"),
        (lambda c: "vocab_size = 256\n", "not valid JSON"),
        (lambda c: json.dumps({**c, "model_type": "gemma"}), "model_type 'gemma' is not supported"),
        (lambda c: json.dumps({**c, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}),
         "use_sliding_window=True is not supported"),
        (lambda c: json.dumps({**c, "mlp_bias": True}), "mlp_bias=True is not supported"),
    ],
    ids=["a-list", "no-vocab-size", "vocab-size-string", "not-json", "gemma", "qwen2-sliding-layers",
         "mlp-bias"],
)
def test_compile_names_config_json_and_what_is_wrong_with_it(hf_model_dir, tmp_path, edit, message):
    model, config = model_copy(hf_model_dir, tmp_path)
    file = model / "config.json"
    file.write_text(edit(json.loads(file.read_text())))
    line = error_line(nb("compile", config, "--out", tmp_path / "out", "--cache-dir", tmp_path / "c"))
    assert f"{file}: " in line and message in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[:-1000], lambda b: b[:1000], lambda b: b"\xff" * 8 + b[8:]],
    ids=["truncated", "cut-in-the-header", "corrupt-header"],
)
def test_compile_names_a_truncated_or_corrupt_checkpoint(hf_model_dir, tmp_path, damage):
    model, config = model_copy(hf_model_dir, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    line = error_line(nb("compile", config, "--out", tmp_path / "out", "--cache-dir", tmp_path / "c"))
    assert f"{weights}: not a complete safetensors file" in line
    assert not (tmp_path / "out").exists()


def _small_files_only() -> None:
    """A disk that fills at 1 MB: writes past it fail with EFBIG instead of killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_fresh_compile_onto_a_full_disk_is_one_error_line(tmp_path):
    out = tmp_path / "out"
    args = ["compile", "--backend", "eager", "--out", out, "--cache-dir", tmp_path / "c"]
    run = subprocess.run(
        [sys.executable, "-c", "from neuron_buckets.cli import app; app()", *map(str, args)],
        preexec_fn=_small_files_only,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert len(errors) == 1 and f"cannot write {out / 'weights.safetensors'}" in errors[0]
    assert "File too large" in errors[0]
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # the weights' temp is gone


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["generate", "--prompt-ids", "1"]])
def test_a_manifest_that_is_a_directory_is_one_error_line(tmp_path, command):
    (tmp_path / "manifest.json").mkdir()
    line = error_line(nb(command[0], tmp_path, *command[1:]))
    assert f"{tmp_path / 'manifest.json'}: cannot read it (Is a directory)" in line


def edited_copy(compiled_dir: Path, tmp_path: Path, edit, forge: bool = False) -> Path:
    """The artifact with its manifest edited; ``forge``: its pieces' ``compiled_for`` too, as if
    they had been compiled so (past the check that each piece was compiled for the manifest, to
    the checks of the values themselves)."""
    copy = Path(shutil.copytree(compiled_dir, tmp_path / "artifact"))
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    if forge:
        facts = Manifest.from_dict(manifest).graph_facts()
        for piece in manifest["pieces"].values():
            piece["compiled_for"] = facts
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


REFUSED_AT_OPEN = {
    "other-torch": (lambda m: m["backend"]["versions"].update(torch="1.0.0"), "compiled for other versions"),
    "wrong-device": (lambda m: m["backend"].update(device="cuda:99"), "cannot serve on device 'cuda:99'"),
    "impossible-geometry": (lambda m: m["cache"].update(head_dim=7), "does not match the model config"),
    "too-few-blocks": (lambda m: m["cache"].update(num_blocks=3), "cannot hold one sequence"),
    "model-config-lacks-a-key": (lambda m: m["model"]["config"].pop("hidden_size"), "lacks 'hidden_size'"),
    "cache-beyond-memory": (lambda m: m["cache"].update(num_blocks=10**13), "needs at least 41.0 PB"),
}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["verify", "generate"])
@pytest.mark.parametrize(("edit", "message"), REFUSED_AT_OPEN.values(), ids=REFUSED_AT_OPEN.keys())
def test_an_artifact_the_runtime_refuses_is_one_error_line(compiled_dir, tmp_path, command, edit, message):
    copy = edited_copy(compiled_dir, tmp_path, edit, forge=True)
    args = ["--prompt-ids", "1,2"] if command == "generate" else []
    assert message in error_line(nb(command, copy, *args))


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("1,,2", "field 2 '' is not an integer"),
        ("\uff11,\uff12", "field 1 '\uff11' is not an integer"),
        ("1.5", "field 1 '1.5' is not an integer"),
        ("1_0", "field 1 '1_0' is not an integer"),
        ("9" * 30, f"field 1 '{'9' * 30}' is beyond int64"),
    ],
    ids=["empty-field", "full-width", "float", "underscore", "beyond-int64"],
)
def test_a_prompt_is_ascii_integers_or_one_error_line(tmp_path, prompt, message):
    line = error_line(nb("generate", tmp_path, "--prompt-ids", prompt))
    assert f"--prompt-ids: expected comma-separated integers; {message}" in line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("input_length,output_length\n5,99999999999999999999\n", "is beyond 4,294,967,296, the largest"),
        ("input_length,output_length\n5," + "1" * 140_000 + "\n", "line 2: field larger than field limit"),
        ('{"input_length": 5, "output_length": 1}\n{"input_length": 6, "output_length": true}\n', "True is"),
        ('{"input_length": 5, "output_length": 1e30}\n', "1e+30 is not an integer token count"),
    ],
    ids=["beyond-int64", "line-over-128KiB", "jsonl-true", "jsonl-1e30"],
)
def test_a_bad_trace_is_one_error_line_naming_the_file(tmp_path, text, message):
    trace = tmp_path / "t.csv"
    trace.write_text(text)
    line = error_line(nb("inspect", "--trace", trace, "--prefill-buckets", "128"))
    assert line.startswith(f"error: {trace}: ") and message in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("generate", "art", "--prompt-ids", "1", "--speculative-ngram", "-1"),
         "Invalid value for '--speculative-ngram': Input should be greater than or equal to 0"),
        (("cache", "prune", "--older-than-days", "-1"),
         "Invalid value for '--older-than-days': Input should be greater than or equal to 0"),
        (("serve", "art", "--port", "70000"), "Invalid value for '--port'"),
        (("generate",), "Missing argument"),
    ],
    ids=["negative-speculative-ngram", "negative-days", "port", "missing-argument"],
)
def test_a_bad_option_value_is_one_error_line_not_a_usage_box(args, message):
    assert message in error_line(nb(*args))


def test_an_unreachable_store_url_is_one_line_naming_it():
    assert "graph store ftp://no-such-host.invalid/x: " in error_line(nb("cache", "pull", "ftp://no-such-host.invalid/x"))


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {"NB_API_KEY": ""}, "error: the API key is empty: give one, or unset NB_API_KEY to serve"),
        (("--api-key", ""), {}, "error: the API key is empty"),
        (("--api-key", "cl\u00e9"), {}, "error: the API key must be printable ASCII without spaces"),
        (("--api-key", "a key"), {}, "error: the API key must be printable ASCII without spaces"),
    ],
    ids=["empty-variable", "empty-option", "not-ascii", "a-space"],
)
def test_an_api_key_that_would_turn_auth_off_or_never_match_is_refused_at_start(tmp_path, args, env, message):
    result = runner.invoke(app, ["serve", str(tmp_path), *args], env=env)
    assert error_line(result).startswith(message)
