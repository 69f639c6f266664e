"""The artifact commands as a user runs them: nb compile, ls, verify, generate, doctor."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import read_manifest, read_manifest_dict
from neuron_buckets.cli import app, console
from neuron_buckets.compile.store_entry import StoreEntry
from tests.conftest import TINY_CONFIG, error_line, write_config

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
    assert [r.status for r in m.buckets] == ["ok"] * 4
    assert [p.status for p in m.pieces.values()] == ["ok"] * 8  # shared embed and head, 4 layers, 2 fresh
    assert (eager_dir / "weights.safetensors").is_file()
    config = tmp_path / "nb.toml"
    again = nb("compile", config, "--out", eager_dir, "--cache-dir", tmp_path / "cache")
    assert again.exit_code == 0, again.output
    assert "4 buckets in 8 pieces" in said(again)
    assert "compiled 0, reused 8, failed 0" in said(again)


def test_compile_reports_a_failed_piece_and_exits_1(hf_model_dir, tmp_path):
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    config = write_config(tmp_path, hf_model_dir, EAGER)
    compiler = Compiler(load_config(config), tmp_path / "art", tmp_path / "cache")
    layer = compiler.plan.bucket_pieces[compiler.plan.buckets[0]]["layer"]
    record = tmp_path / "cache" / StoreEntry.record_name(compiler.plan.keys[layer], "json")
    record.mkdir(parents=True)  # its publish fails
    result = nb("compile", config, "--out", tmp_path / "art", "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 1
    assert f"failed {layer.name}:" in said(result) and "exists and is not a record" in said(result)
    assert "bug in nb" not in said(result)  # exit 1 is the expected outcome, not a crash
    assert f"logs/{layer.name}.log" in said(result)
    assert "compiled 7, reused 0, failed 1" in said(result)


def test_ls_lists_every_bucket_with_its_pieces(eager_dir, monkeypatch):
    monkeypatch.setattr(console.out, "width", 200)  # wide enough that every row is one line
    result = nb("ls", eager_dir)
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") > 2}
    expected = {  # a packed bucket's layer and its fresh layer (over no context)
        "prefill_s16": ["layer_t16_b2_c128_packed", "layer_t16_b2_c0_packed"],
        "prefill_s32": ["layer_t32_b2_c128_packed", "layer_t32_b2_c0_packed"],
        "decode_b1_c128": ["layer_t1_b1_c128"],
        "decode_b2_c128": ["layer_t2_b2_c128"],
    }
    assert set(rows) == {*expected, "shared *"}
    for bucket, layers in expected.items():
        cells = [c.strip() for c in rows[bucket].split("│")]
        assert cells[2] == "ok" and sorted(cells[3].split()) == sorted(["embed*", "head*", *layers])
    assert rows["shared *"].split("│")[3].split() == ["embed", "head"]
    sizes = [float(line.split("│")[4].split()[0]) for line in rows.values()]
    seconds = [float(line.split("│")[5]) for line in rows.values()]
    text = said(result)
    assert "4 of 4 buckets ok, 8 of 8 pieces ok" in text
    total = re.search(r"the rows' pieces: ([\d.]+) MB, ([\d.]+) s of compile", text)
    assert total and float(total[1]) == pytest.approx(sum(sizes), abs=0.051 * len(sizes))  # rows add up
    assert float(total[2]) == pytest.approx(sum(seconds), abs=0.051 * len(seconds))


def test_ls_of_a_directory_without_manifest_is_one_clear_error(tmp_path):
    result = nb("ls", tmp_path)
    assert result.exit_code == 2
    assert "manifest.json is missing" in said(result) and "Traceback" not in result.output


def test_generate_prints_tokens_and_stats(eager_dir):
    result = nb(
        "generate", eager_dir, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "3",
        "--stats", "--ignore-eos",
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line and line[0].isdigit()]
    assert len(lines) == 2 and all(len(line.split(",")) == 3 for line in lines)
    stats = {
        cells[0]: cells[1:]
        for line in result.output.splitlines()
        if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 5
    }
    assert stats["prefill_s16"] == ["1", "5", "16", "68.8%"]  # both prompts in one call, 11 of 16 padding
    assert stats["decode_b2_c128"][0] == "2"  # then both decode together, twice


def test_generate_with_a_temperature_or_top_p_that_underflows_in_float32_prints_greedys_tokens(eager_dir):
    args = ("generate", eager_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--ignore-eos")
    greedy = nb(*args, "--seed", "1")
    assert greedy.exit_code == 0, greedy.output
    for knobs in (("--temperature", "1e-45"), ("--temperature", "1", "--top-p", "1e-50")):
        result = nb(*args, "--seed", "1", *knobs)
        assert result.exit_code == 0, result.output
        assert result.stdout == greedy.stdout, knobs


def test_generate_stats_print_the_prefix_cache_hit_rate(eager_dir):
    # 40 tokens take the whole first step (budget 32); the second prompt enters the next step and
    # finds the first one's four full blocks cached
    first = list(range(1, 41))
    second = first[:32] + [7, 7]
    result = nb(
        "generate", eager_dir, "--prompt-ids", ",".join(map(str, first)),
        "--prompt-ids", ",".join(map(str, second)), "--max-new-tokens", "2", "--stats",
    )
    assert result.exit_code == 0, result.output
    assert "prefix cache: 32 of 74 prompt tokens hit (43%)" in result.output
    # 6 blocks for the first's 41 tokens and one of the second's own: the other 4 are the first's
    assert "KV cache: 0 preemptions, at most 11% of 63 blocks in use" in result.output


def test_generate_refuses_bad_prompts(eager_dir):
    assert nb("generate", eager_dir, "--prompt-ids", "1,x").exit_code == 2
    too_long = ",".join(["1"] * 200)  # max_model_len is 128
    result = nb("generate", eager_dir, "--prompt-ids", too_long, "--max-new-tokens", "2")
    assert result.exit_code == 2 and "max_model_len" in said(result)
    assert "has no tokenizer" in error_line(nb("generate", eager_dir, "--prompt", "hi"))  # model dir had none
    assert "one of the two" in error_line(nb("generate", eager_dir, "--prompt", "hi", "--prompt-ids", "1"))
    bad_top_p = nb("generate", eager_dir, "--prompt-ids", "1", "--top-p", "0")
    assert "top_p must be in (0, 1]" in error_line(bad_top_p)


@pytest.mark.slow
def test_verify_passes_on_a_compiled_artifact(compiled_dir):
    result = nb("verify", compiled_dir)
    assert result.exit_code == 0, result.output
    assert result.output.count(" ok ") >= 4 and "FAIL" not in result.output


@pytest.mark.slow
def test_verify_catches_a_tampered_graph_and_an_edited_manifest(compiled_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(compiled_dir, copy, copy_function=shutil.copy)  # real copies, not links
    m = read_manifest(copy)
    rec = m.pieces[m.buckets[0].pieces["layer"]]
    with open(copy / rec.file, "r+b") as f:
        f.seek(100)
        f.write(b"\x00tampered\x00")
    result = nb("verify", copy)
    # the problem names the piece and its file by relative path; the other files pass
    assert result.exit_code == 1
    assert f"{rec.name} file {rec.file} does not match its sha256" in said(result)
    assert said(result).count("problem:") == 1

    shutil.rmtree(copy)
    shutil.copytree(compiled_dir, copy, copy_function=shutil.copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["cache"]["num_blocks"] = "many"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = nb("verify", copy)
    assert result.exit_code == 2 and "num_blocks" in said(result)

    shutil.rmtree(copy)
    shutil.copytree(compiled_dir, copy, copy_function=shutil.copy)
    embed_file = copy / read_manifest(copy).pieces[read_manifest(copy).buckets[0].pieces["embed"]].file
    embed_file.unlink()
    result = nb("verify", copy)
    assert result.exit_code == 1
    assert f"embed file {embed_file.relative_to(copy).as_posix()} is missing" in said(result)


def test_doctor_reports_each_backend_and_why_neuron_is_unusable():
    result = nb("doctor")
    assert result.exit_code == 0, result.output
    for name in ("inductor", "eager", "neuron"):
        assert name in result.output
    try:
        import torch_neuronx  # noqa: F401
    except ImportError:
        assert "pip install" in said(result) and "torch-neuronx" in said(result)


def test_buckets_share_piece_files_and_the_one_weights_copy(eager_dir):
    """The dynamic embed and head are one file each that every bucket references; pieces hold
    no weights: every layer call gets its views of the runtime's one weights dict."""
    from neuron_buckets.runtime.bucket_runtime import BucketRuntime

    doc = read_manifest_dict(eager_dir)
    for role in ("embed", "head"):
        keys = {b["pieces"][role] for b in doc["buckets"]}
        assert len(keys) == 1, role  # one piece for all four buckets
        (key,) = keys
        assert doc["pieces"][key]["name"] == role
        assert sum(p["file"] == doc["pieces"][key]["file"] for p in doc["pieces"].values()) == 1
    assert len({b["pieces"]["layer"] for b in doc["buckets"]}) == 4

    runtime = BucketRuntime.open(eager_dir, preload=True)
    assert sorted(runtime.loaded) == sorted(doc["pieces"])  # each shared piece loaded once
    assert len(runtime.loaded) == 8
    for key in runtime.loaded:
        assert list(runtime.graph(key).piece.parameters()) == []
    shared = {t.data_ptr() for t in runtime.weights.tensors()}
    assert len(runtime.layer_weights) == runtime.config.num_layers
    for layer in runtime.layer_weights:
        assert {t.data_ptr() for t in layer} <= shared
    assert runtime.embed_weight.data_ptr() in shared
    assert {t.data_ptr() for t in runtime.head_weights} <= shared
