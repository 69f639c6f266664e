"""The artifact commands as a user runs them: nb compile, ls, verify, generate, doctor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.cli import app
from tests.conftest import TINY_CONFIG, write_config

runner = CliRunner()
EAGER = TINY_CONFIG.replace('backend = "inductor"', 'backend = "eager"')


def nb(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def said(result) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(result.output.split())


@pytest.fixture
def eager_dir(hf_model_dir: Path, tmp_path: Path) -> Path:
    config = write_config(tmp_path, hf_model_dir, EAGER)
    out = tmp_path / "art"
    result = nb("compile", config, "--out", out, "--cache-dir", tmp_path / "cache", "--jobs", "2")
    assert result.exit_code == 0, result.output
    return out


def test_compile_writes_the_artifact_and_a_rerun_compiles_nothing(eager_dir, tmp_path):
    m = read_manifest(eager_dir)
    assert [r["status"] for r in m["buckets"]] == ["ok"] * 4
    assert (eager_dir / "weights.safetensors").is_file()
    config = tmp_path / "nb.toml"
    again = nb("compile", config, "--out", eager_dir, "--cache-dir", tmp_path / "cache")
    assert again.exit_code == 0, again.output
    assert "compiled 0, reused 4, failed 0" in again.output


def test_ls_lists_every_bucket(eager_dir):
    result = nb("ls", eager_dir)
    assert result.exit_code == 0, result.output
    for name in ("prefill b1 s16 c128", "prefill b1 s32 c128", "decode b1 s1 c128", "decode b2 s1 c128"):
        assert name in result.output
    for rec in read_manifest(eager_dir)["buckets"]:
        assert rec["key"][:12] in result.output
    assert "4 of 4 graphs ok" in said(result)


def test_ls_of_a_directory_without_manifest_is_one_clear_error(tmp_path):
    result = nb("ls", tmp_path)
    assert result.exit_code == 2
    assert "manifest.json is missing" in said(result) and "Traceback" not in result.output


def test_generate_prints_tokens_and_stats(eager_dir):
    result = nb(
        "generate", eager_dir, "--prompt", "1,2,3", "--prompt", "4,5", "--max-new-tokens", "3", "--stats"
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line and line[0].isdigit()]
    assert len(lines) == 2 and all(len(line.split(",")) == 3 for line in lines)
    assert "prefill_s16" in result.output and "decode_b2" in result.output


def test_generate_refuses_bad_prompts(eager_dir):
    assert nb("generate", eager_dir, "--prompt", "1,x").exit_code == 2
    too_long = ",".join(["1"] * 200)  # max_model_len is 128
    result = nb("generate", eager_dir, "--prompt", too_long, "--max-new-tokens", "2")
    assert result.exit_code == 2 and "max_model_len" in said(result)


@pytest.mark.slow
def test_verify_passes_on_a_compiled_artifact(compiled_dir):
    result = nb("verify", compiled_dir)
    assert result.exit_code == 0, result.output
    assert result.output.count(" ok ") >= 4 and "FAIL" not in result.output


@pytest.mark.slow
def test_verify_catches_a_tampered_graph_and_an_edited_manifest(compiled_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(compiled_dir, copy, copy_function=shutil.copy)  # real copies, not links
    rec = read_manifest(copy)["buckets"][0]
    with open(copy / rec["file"], "r+b") as f:
        f.seek(100)
        f.write(b"\x00tampered\x00")
    result = nb("verify", copy)
    assert result.exit_code == 1 and "does not match its sha256" in said(result)

    shutil.rmtree(copy)
    shutil.copytree(compiled_dir, copy, copy_function=shutil.copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["cache"]["num_blocks"] = "many"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = nb("verify", copy)
    assert result.exit_code == 2 and "num_blocks" in said(result)


def test_doctor_reports_each_backend_and_why_neuron_is_unusable():
    result = nb("doctor")
    assert result.exit_code == 0, result.output
    for name in ("inductor", "eager", "neuron"):
        assert name in result.output
    try:
        import torch_neuronx  # noqa: F401
    except ImportError:
        assert "pip install" in said(result) and "torch-neuronx" in said(result)


def test_compile_with_the_neuron_backend_fails_at_once_with_an_install_hint(tmp_path):
    try:
        import torch_neuronx  # noqa: F401

        pytest.skip("the Neuron SDK is installed here; this checks the refusal without it")
    except ImportError:
        pass
    result = nb("compile", "--backend", "neuron", "--out", tmp_path / "out", "--cache-dir", tmp_path / "c")
    assert result.exit_code == 2
    assert "pip install" in said(result) and "neuron" in said(result)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_eager_graphs_share_the_one_weights_copy(eager_dir):
    from neuron_buckets.serve.runtime import BucketRuntime

    runtime = BucketRuntime.open(eager_dir, preload=True)
    shared = {t.data_ptr() for t in runtime.weights.values()}
    assert len(runtime.loaded) == 4
    for bucket in runtime.loaded:
        assert {p.data_ptr() for p in runtime.graph(bucket).model.parameters()} <= shared
