"""`nb inspect` and `nb plan` through typer: JSON alone on stdout with numbers a plain loop
reproduces exactly, the bucket sources (options, config, manifest), and one clear error line."""

from __future__ import annotations

import csv
import json
import tomllib
from pathlib import Path

import pytest
from test_traces import CODE, CONV
from typer.testing import CliRunner

from neuron_buckets import __version__
from neuron_buckets.artifact.manifest import validate
from neuron_buckets.cli import app
from neuron_buckets.config import parse_config
from neuron_buckets.model.model_source import model_config_of
from tests.conftest import error_line

runner = CliRunner()


def nb(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def nb_json(*args: str) -> dict:
    result = nb(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stdout holds the document and nothing else


def plain_padding(prompts: list[int], buckets: list[int]) -> tuple[int, int, list[int]]:
    """Real tokens, padded tokens and calls per bucket, one prompt and one chunk at a time."""
    real = padded = 0
    calls = [0] * len(buckets)
    for n in prompts:
        real += n
        while n > 0:
            chunk = min(n, buckets[-1])
            i = next(i for i, b in enumerate(buckets) if b >= chunk)
            calls[i] += 1
            padded += buckets[i]
            n -= chunk
    return real, padded, calls


def prompts_of(path: Path, max_model_len: int | None = None) -> list[int]:
    """The trace's prompt lengths; with ``max_model_len``, of the requests a server runs."""
    with path.open(newline="") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    return [p for p, o in rows if max_model_len is None or p + max(o, 1) <= max_model_len]


def check_exact(section: dict, prompts: list[int]) -> None:
    real, padded, calls = plain_padding(prompts, section["buckets"])
    assert section["requests"] == len(prompts)
    assert (section["real_tokens"], section["padded_tokens"]) == (real, padded)
    assert section["padding_ratio"] == (padded - real) / real
    assert [b["calls"] for b in section["per_bucket"]] == calls


@pytest.mark.parametrize("path", [CODE, CONV], ids=["code", "conv"])
def test_plan_json_is_exact_and_beats_powers_of_two(path: Path) -> None:
    prompts = prompts_of(path)
    pow2 = [128]
    while pow2[-1] < max(prompts):
        pow2.append(2 * pow2[-1])
    doc = nb_json("plan", "--trace", path, "--graphs", len(pow2))
    prefill = doc["prefill"]
    assert prefill["baseline"]["buckets"] == pow2
    check_exact(prefill, prompts)
    check_exact(prefill["baseline"], prompts)
    assert len(prefill["buckets"]) <= len(pow2)
    assert all(b % 64 == 0 for b in prefill["buckets"])
    assert prefill["padding_ratio"] <= 0.6 * prefill["baseline"]["padding_ratio"]


def test_inspect_json_is_exact_for_explicit_buckets() -> None:
    buckets = [256, 1024, 2048, 4096]
    doc = nb_json("inspect", "--trace", CODE, "--prefill-buckets", ",".join(map(str, buckets)))
    check_exact(doc["prefill"], prompts_of(CODE))
    assert doc["prefill"]["chunked_requests"] == sum(n > 4096 for n in prompts_of(CODE))
    decode = doc["decode"]
    # the config's default max_num_seqs, the one nb plan and nb inspect use too
    assert decode["buckets"] == [1, 2, 4] and decode["max_num_seqs"] == 4
    assert decode["peak_batch"] <= 4 and decode["padding_share"] > 0
    assert doc["graphs"] is None


def test_inspect_reads_buckets_from_a_config_or_the_embedded_default(tmp_path: Path) -> None:
    config = tmp_path / "nb.toml"
    config.write_text(
        "[buckets]\nmax_num_seqs = 8\nmax_num_batched_tokens = 4096\n"
        'num_batched_tokens_buckets = { strategy = "powers_of_two", min = 512 }\n'
    )
    doc = nb_json("inspect", "--trace", CONV, config)
    assert doc["prefill"]["buckets"] == [512, 1024, 2048, 4096]
    assert doc["decode"]["buckets"] == [1, 2, 4, 8] and doc["decode"]["peak_batch"] == 8
    served = prompts_of(CONV, 256)  # the config's max_model_len: the default
    check_exact(doc["prefill"], served)
    assert doc["refused"] == {"requests": 19366 - len(served), "of": 19366, "max_model_len": 256}
    assert nb_json("inspect", "--trace", CONV)["prefill"]["buckets"] == [32, 64, 128]


SHARED = [("embed", "embed", 0.5, 1000), ("head", "head", 1.5, 2000)]  # (role, name, seconds, bytes)


def manifest_of(layers: list[tuple[str, int, int, int, float, int]], max_model_len: int) -> dict:
    """A schema-valid artifact manifest whose buckets all compiled: one per ``(kind, batch, seq,
    ctx, layer seconds, layer bytes)``, each with a layer piece of its own beside the shared embed
    (0.5 s, 1000 bytes) and head (1.5 s, 2000 bytes), so a bucket costs its layer plus 2 s and
    3000 bytes."""
    names = [*SHARED, *(("layer", f"layer_{i}", secs, size) for i, (*_, secs, size) in enumerate(layers))]
    pieces = {
        f"{i:016x}": {
            "role": role, "name": name, "file": f"graphs/{i:016x}.pt2", "sha256": "0" * 64, "bytes": size,
            "compile_seconds": secs, "cached": False, "status": "ok", "error": None, "log": None,
        }
        for i, (role, name, secs, size) in enumerate(names)
    }  # fmt: skip
    buckets = [
        {
            "kind": kind, "batch": batch, "seq": seq, "ctx": ctx, "status": "ok", "error": None,
            "pieces": {"embed": f"{0:016x}", "head": f"{1:016x}", "layer": f"{i + 2:016x}"},
        }
        for i, (kind, batch, seq, ctx, *_) in enumerate(layers)
    ]  # fmt: skip
    manifest = {
        "schema_version": 2,
        "toolchain": {"name": "neuron-buckets", "version": __version__},
        "created": "2024-01-01T00:00:00+00:00",
        "backend": {
            "name": "eager", "device": "cpu", "versions": {"torch": "2", "compiler": "-"}, "flags": {},
        },
        "model": {"source": "embedded-default", "config": model_config_of(None).to_hf(), "dtype": "float32"},
        "weights": {"file": "weights.safetensors", "sha256": "0" * 64, "bytes": 1},
        "cache": {
            "block_size": 16, "num_blocks": max_model_len // 16 + 1, "num_layers": 2, "num_kv_heads": 2,
            "head_dim": 16, "dtype": "float32", "max_model_len": max_model_len,
        },
        "decode": {"speculation_length": 0, "max_num_seqs": 2, "max_num_batched_tokens": 1024},
        "pieces": pieces,
        "buckets": buckets,
    }  # fmt: skip
    return validate(manifest)


def write_manifest(directory: Path, manifest: dict | None = None) -> Path:
    """``manifest`` (by default: prefill 512/1024 and decode 1/2 at ctx 4096) as the manifest of
    the artifact directory ``directory``."""
    default = [  # (kind, batch, seq, ctx, layer seconds, layer bytes)
        ("prefill", 2, 512, 4096, 8.0, 512000),
        ("prefill", 2, 1024, 4096, 16.0, 1024000),
        ("decode", 1, 1, 4096, 2.0, 1000),
        ("decode", 2, 1, 4096, 3.0, 2000),
    ]
    (directory / "manifest.json").write_text(json.dumps(manifest or manifest_of(default, 4096)))
    return directory


def test_inspect_takes_buckets_and_compile_costs_from_a_manifest(tmp_path: Path) -> None:
    doc = nb_json("inspect", "--trace", CODE, "--manifest", write_manifest(tmp_path))
    assert doc["prefill"]["buckets"] == [512, 1024] and doc["decode"]["buckets"] == [1, 2]
    graphs = {(g["kind"], g["batch"], g["seq"]): g for g in doc["graphs"]}
    # a bucket costs its three pieces, the shared embed and head included: 16 + 0.5 + 1.5 s
    assert graphs[("prefill", 1, 1024)] == {
        "kind": "prefill", "batch": 1, "seq": 1024, "ctx": 4096, "seconds": 18.0, "bytes": 1027000,
        "measured": True,
    }  # fmt: skip
    assert (graphs[("decode", 2, 1)]["seconds"], graphs[("decode", 2, 1)]["bytes"]) == (5.0, 5000)
    doc = nb_json("inspect", "--trace", CODE, "--manifest", tmp_path, "--prefill-buckets", "512,2048")
    guess = doc["graphs"][1]  # 2048 was not compiled: a line through the measured graphs
    assert (guess["seq"], guess["measured"]) == (2048, False)
    assert guess["seconds"] > 18.0 and guess["bytes"] > 1027000


def test_decode_buckets_differing_only_in_context_keep_their_own_compile_cost(tmp_path: Path) -> None:
    """Each (batch, ctx) decode graph is priced with its own pieces: a longer context is another
    graph, which neither replaces nor is replaced by the shorter one's measurement."""
    layers = [
        ("prefill", 2, 512, 512, 8.0, 8000),
        ("decode", 1, 1, 256, 2.0, 100),
        ("decode", 1, 1, 512, 4.0, 200),
        ("decode", 2, 1, 256, 3.0, 300),
        ("decode", 2, 1, 512, 6.0, 400),
    ]
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n300,7\n")
    artifact = write_manifest(tmp_path, manifest_of(layers, 512))
    graphs = nb_json("inspect", "--trace", trace, "--manifest", artifact)["graphs"]
    decode = sorted(
        (g["batch"], g.get("ctx"), g["seconds"], g["bytes"]) for g in graphs if g["kind"] == "decode"
    )
    assert decode == [(1, 256, 4.0, 3100), (1, 512, 6.0, 3200), (2, 256, 5.0, 3300), (2, 512, 8.0, 3400)]
    assert all(g["measured"] for g in graphs)


def test_a_schema_version_1_manifest_is_refused_with_the_way_out(tmp_path: Path) -> None:
    doc = json.loads(write_manifest(tmp_path).joinpath("manifest.json").read_text())
    doc["schema_version"] = 1
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n300,7\n")
    result = nb("inspect", "--trace", trace, "--manifest", tmp_path, "--json")
    assert result.exit_code == 2 and result.stdout == ""
    message = " ".join(result.stderr.split())
    assert "schema_version 1" in message and "run nb compile again" in message


def test_plan_under_a_compile_budget(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path)
    free = nb_json("plan", "--trace", CODE, "--graphs", 7, "--manifest", manifest)
    budget = free["pareto"][2]["total_compile_seconds"] + 0.01
    doc = nb_json(
        "plan", "--trace", CODE, "--graphs", 7, "--manifest", manifest, "--max-compile-seconds", budget
    )
    assert doc["compile_seconds"] <= budget
    assert doc["prefill"]["buckets"] == free["pareto"][2]["buckets"]


def test_plan_toml_snippet_is_a_valid_config() -> None:
    doc = nb_json(
        "plan", "--trace", CONV, "--graphs", 6, "--align", 16, "--max-num-batched-tokens", 2048,
        "--max-model-len", 4096,
    )
    snippet = tomllib.loads(doc["toml"])
    assert snippet["cache"]["max_model_len"] == 4096 and doc["refused"]["requests"] > 0
    buckets = parse_config(snippet).buckets
    assert list(buckets.decode_context_length_buckets) == doc["context"]["buckets"]
    assert list(buckets.num_batched_tokens_buckets) == doc["prefill"]["buckets"]
    assert list(buckets.num_seqs_buckets) == doc["decode"]["buckets"]
    assert buckets.max_num_batched_tokens == 2048 and doc["prefill"]["chunked_requests"] > 0
    assert all(b % 16 == 0 for b in doc["prefill"]["buckets"])


def test_plan_holdout_and_rich_output(tmp_path: Path) -> None:
    result = nb("plan", "--trace", CONV, "--graphs", 8, "--holdout-split", 0.8)
    assert result.exit_code == 0, result.output
    for text in ("prefill plans", "powers of two", "holdout (last 20% by arrival", "[buckets]"):
        assert text in result.stdout
    assert "loaded 19,366 requests" in result.stderr and "loaded" not in result.stdout
    doc = nb_json("plan", "--trace", CONV, "--graphs", 8, "--holdout-split", 0.8)
    assert doc["holdout"]["eval_requests"] == 19366 - round(0.8 * 19366)


def test_inspect_rich_output_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "lengths.png"
    result = nb("inspect", "--trace", CODE, "--prefill-buckets", "1024,4096", "--plot", png)
    assert result.exit_code == 0, result.output
    assert "prefill padding" in result.stdout and "decode padding" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "--prefill-buckets", "128,abc"], "comma-separated integers"),
        (["inspect", "--prefill-buckets", "256,128"], "strictly ascending"),
        (["plan", "--graphs", "3", "--max-compile-seconds", "10"], "needs a compile-time model"),
        (["plan", "--graphs", "3", "--holdout-split", "0.5"], "needs arrival times"),
        (["plan", "--graphs", "3", "--max-num-batched-tokens", "32"], "below align=64"),
    ],
)
def test_bad_options_get_one_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n300,7\n")
    result = nb(*args, "--trace", trace)
    assert result.exit_code == 2 and result.stdout == ""
    assert message in " ".join(result.stderr.split())


def test_bad_trace_gets_one_clear_error(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("prompt,answer\n100,5\n")
    for command in (["inspect"], ["plan", "--graphs", "2"]):
        result = nb(*command, "--trace", trace, "--json")
        assert result.exit_code == 2 and result.stdout == ""
        assert "found ['prompt', 'answer']" in " ".join(result.stderr.split())


REPLAY_CONFIG = """
[cache]
block_size = 8
num_blocks = 256
max_model_len = 256

[buckets]
max_num_seqs = 4
max_num_batched_tokens = 128
num_seqs_buckets = [1, 2, 4]
num_batched_tokens_buckets = {buckets}
"""


def test_plan_picks_token_buckets_that_pad_the_replayed_steps_less(tmp_path: Path) -> None:
    """Prompts of 40 tokens of 2, 5 or 9 output tokens at concurrency 2: the replayed packed
    calls hold one 40-token prompt, which powers of two pad to 64 (the other request's decode row
    rides there). The plan's buckets pad them less (in a 40-token bucket no row rides), and nb
    inspect replaying a config with those buckets counts the calls and positions the plan said."""
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "40,2\n40,5\n40,9\n" * 10)
    config = tmp_path / "nb.toml"
    config.write_text(REPLAY_CONFIG.format(buckets="[32, 64, 128]"))
    doc = nb_json("plan", "--trace", trace, config, "--graphs", 3, "--align", 8, "--concurrency", 2)
    replay = doc["replay"]
    assert replay["load"]["concurrency"] == 2 and replay["requests"] == 30
    assert replay["baseline"]["buckets"] == [32, 64, 128] and replay["buckets"][-1] == 128
    assert replay["padded_tokens"] < replay["baseline"]["padded_tokens"]
    assert 40 in replay["buckets"]  # a prompt's own length, a multiple of 8
    assert doc["prefill"]["buckets"] == [40]  # the offline optimum: each prompt alone
    snippet = tomllib.loads(doc["toml"])["buckets"]
    assert snippet["num_batched_tokens_buckets"] == replay["buckets"]
    assert snippet["max_num_batched_tokens"] == 128
    shown = nb("plan", "--trace", trace, config, "--graphs", 3, "--align", 8, "--concurrency", 2).stdout
    for text in ("offline per-request optimum", "replayed steps: 30 requests, concurrency 2", "replay plan"):
        assert text in " ".join(shown.split())
    at_once = nb_json("plan", "--trace", trace, config, "--graphs", 3, "--align", 8)["replay"]
    assert at_once["load"]["concurrency"] is None and at_once["calls"] != replay["calls"]

    config.write_text(REPLAY_CONFIG.format(buckets=replay["buckets"]))
    packed = nb_json("inspect", "--trace", trace, config, "--concurrency", 2)["packed"]
    prefill = [b for b in packed["per_bucket"] if b["bucket"].startswith("prefill")]
    assert sum(b["padded_tokens"] for b in prefill) == replay["padded_tokens"]
    assert sum(b["calls"] for b in prefill) == replay["calls"]


def test_replay_options_need_a_config_grid_and_arrival_times(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n300,7\n")
    result = nb("inspect", "--trace", trace, "--prefill-buckets", "128,256", "--concurrency", 2)
    assert error_line(result).endswith("pass a CONFIG, not --manifest or buckets")
    for command in (["inspect"], ["plan", "--graphs", "2"]):
        result = nb(*command, "--trace", trace, "--arrivals", "--json")
        assert result.exit_code == 2 and result.stdout == ""
        assert "error: --arrivals: the trace has no TIMESTAMP or timestamp column" in result.stderr


def test_inspect_replays_arrivals_on_the_modelled_clock(tmp_path: Path) -> None:
    """Two requests a minute apart run alone, so the clock ends at the second arrival plus its
    steps; at once they share steps."""
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,input_length,output_length\n0,20,3\n60000,20,3\n")
    config = tmp_path / "nb.toml"
    config.write_text(REPLAY_CONFIG.format(buckets="[32, 64, 128]"))
    options = ["--step-seconds", "0.5", "--token-seconds", "0"]
    spaced = nb_json("inspect", "--trace", trace, config, "--arrivals", *options)["packed"]
    together = nb_json("inspect", "--trace", trace, config, *options)["packed"]
    assert spaced["load"] == {"concurrency": None, "arrivals": True, "step_seconds": 0.5, "token_seconds": 0}
    assert (spaced["steps"], together["steps"]) == (6, 3)  # a prefill step, then 2 decode steps each
    assert spaced["replayed_seconds"] == 60 + 3 * 0.5
    result = nb("inspect", "--trace", trace, config, "--arrivals", "--concurrency", 1)
    assert "2 requests, at their arrivals (0.1 s/step + 0.002 s/token), at most 1 in flight" in " ".join(
        result.stdout.split()
    )
