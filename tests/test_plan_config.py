"""`nb plan`'s advice pastes and compiles; `nb inspect` never hides the requests it drops.

For every shipped trace, with and without a CONFIG, the [cache] and [buckets] sections `nb plan`
writes replace those of `manifests/default.toml` as they are, and `nb compile --dry-run` accepts
the result. A replay on a config too short for the trace counts the requests it refuses, says
so first, and leaves them out of every padding figure."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_cli_traffic import nb, nb_json, plain_padding, prompts_of
from test_traces import CONV, TRACES

from neuron_buckets.config import parse_config
from neuron_buckets.traffic.plot import plot_title

DEFAULT = Path(__file__).parents[1] / "manifests" / "default.toml"
SHIPPED = sorted(TRACES.glob("*.csv"))


def paste(config: str, block: str) -> str:
    """``config`` with its [cache] and [buckets] sections replaced by ``block``'s, as a user
    pastes a plan: every other line stays where it is."""
    kept, skipping = [], False
    for line in config.splitlines():
        if header := re.match(r"\s*\[([^\]]+)\]", line):
            skipping = header[1] in ("cache", "buckets")
        if not skipping:
            kept.append(line)
    return "\n".join(kept) + "\n" + block


@pytest.mark.parametrize("with_config", [False, True], ids=["alone", "with-config"])
@pytest.mark.parametrize("trace", SHIPPED, ids=lambda p: p.stem)
def test_the_plan_pastes_into_the_default_config_and_compiles(
    tmp_path: Path, trace: Path, with_config: bool
) -> None:
    out = tmp_path / "plan.toml"
    config = [DEFAULT] if with_config else []
    doc = nb_json("plan", "--trace", trace, *config, "--graphs", 6, "--out", out)
    block = out.read_text()
    assert block == doc["toml"]
    pasted = tmp_path / "nb.toml"
    pasted.write_text(paste(DEFAULT.read_text(), block))
    cfg = parse_config(tomllib.loads(pasted.read_text()))
    planned = doc["config"]["buckets"]
    assert list(cfg.buckets.num_batched_tokens_buckets) == planned["num_batched_tokens_buckets"]
    assert cfg.buckets.num_seqs_buckets[:3] == (1, 2, 4)  # a lone request runs in a 1-row graph
    limits = (cfg.cache.max_model_len, cfg.buckets.max_num_seqs, cfg.buckets.max_num_batched_tokens)
    if with_config:  # the config's limits are kept
        assert limits == (256, 4, 128) and doc["refused"]["requests"] > 0
        assert doc["config"]["changes"] == []
    else:  # sized for the trace: nothing refused, every request fits
        assert doc["refused"]["requests"] == 0
        assert cfg.cache.max_model_len >= max(p + 1 for p in prompts_of(trace))
        changes = doc["config"]["changes"]
        assert any(line.startswith("changes cache.max_model_len 256 -> ") for line in changes)
    assert cfg.cache.num_blocks > cfg.cache.max_model_len // cfg.cache.block_size
    result = nb("compile", pasted, "--dry-run", "--out", tmp_path / "art", "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 0, result.output
    assert "pieces to compile" in result.stdout


def test_an_embedding_config_gets_a_plan_of_prefill_buckets_only_that_loads(tmp_path: Path) -> None:
    """An embedding artifact never decodes: its replay runs prefills alone, and the plan leaves out
    the decode keys such a config refuses; the pasted config parses and lists prefill buckets only."""
    embed = paste(DEFAULT.read_text(), "[cache]\n[buckets]\nmax_num_batched_tokens = 128\n")
    embed = embed.replace("[model]\n", '[model]\ntask = "embed"\n')
    config = tmp_path / "embed.toml"
    config.write_text(embed)
    doc = nb_json("plan", "--trace", CONV, config, "--graphs", 3)
    assert "num_seqs_buckets" not in doc["config"]["buckets"] and doc["replay"]["calls"] > 0
    cfg = parse_config(tomllib.loads(paste(embed, doc["toml"])))
    assert cfg.model.embeds and list(cfg.buckets.num_batched_tokens_buckets) == doc["replay"]["buckets"]


def test_a_config_the_plan_must_change_says_which_key_and_why(tmp_path: Path) -> None:
    """A pool too small for what the replay holds at once: the plan raises num_blocks, in one
    line naming the key, and the pasted config compiles."""
    small = tmp_path / "small.toml"
    small.write_text(paste(DEFAULT.read_text(), "[cache]\nnum_blocks = 17\n[buckets]\nmax_num_seqs = 4\n"))
    doc = nb_json("plan", "--trace", CONV, small, "--graphs", 3)
    (line,) = doc["config"]["changes"]
    assert line.startswith("changes cache.num_blocks 17 -> ") and "at once" in line
    assert doc["config"]["cache"]["num_blocks"] > 17
    shown = " ".join(nb("plan", "--trace", CONV, small, "--graphs", 3).stdout.split())
    comments = " ".join(c.lstrip("# ") for c in doc["toml"].splitlines() if c.startswith("#"))
    assert line in shown and line in comments  # in the sections too, as a comment


def test_inspect_counts_the_requests_a_short_config_refuses_everywhere(tmp_path: Path) -> None:
    png = tmp_path / "padding.png"
    doc = nb_json("inspect", "--trace", CONV, DEFAULT)
    served = prompts_of(CONV, 256)
    refused = doc["refused"]
    assert list(doc)[0] == "refused"  # reported first
    assert refused == {"requests": 19366 - len(served), "of": 19366, "max_model_len": 256}
    assert refused["requests"] > 18000
    prefill = doc["prefill"]
    real, computed, _ = plain_padding(served, prefill["buckets"])
    assert prefill["requests"] == len(served) and prefill["real_tokens"] == real
    assert prefill["computed_tokens"] == computed and prefill["padding_share"] == (computed - real) / computed
    assert doc["packed"]["requests"] == min(1000, len(served))
    table = nb("inspect", "--trace", CONV, DEFAULT, "--plot", png).stdout
    assert table.splitlines()[0].startswith(f"refused: {refused['requests']:,} of 19,366 requests")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    title = plot_title(prefill, refused, "default.toml")
    assert f"{refused['requests']:,} of 19,366 refused (longer than max_model_len 256)" in title


def test_the_padding_terms_agree_between_json_metrics_stats_and_plot(capsys) -> None:
    """One replay, four outputs: nb inspect --json, the server's /metrics and nb generate's
    --stats table over the replay's counters, and the plot's title say the same computed tokens
    and padding share."""
    from prometheus_client.parser import text_string_to_metric_families

    from neuron_buckets.cli.generate import print_stats
    from neuron_buckets.config import enumerate_grid, load_config
    from neuron_buckets.engine.spec_decode_stats import SpecDecodeStats
    from neuron_buckets.server.metrics import ServerMetrics
    from neuron_buckets.traffic.runtime_replay import fit_requests, replay_runtime
    from neuron_buckets.traffic.traces import load_trace

    doc = nb_json("inspect", "--trace", CONV, DEFAULT, "--replay-requests", 50)
    packed = doc["packed"]
    cfg = load_config(DEFAULT)
    trace = load_trace(CONV).servable(256)
    lens, outputs = fit_requests(trace.prompt_lens, trace.output_lens, 256, 50)
    replay = replay_runtime(lens, outputs, enumerate_grid(cfg), cfg.cache.num_blocks, cfg.cache.block_size)
    metrics = ServerMetrics("tiny", lambda: replay.stats).exposition().decode()
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    share = {s.labels["bucket"]: s.value for s in families["nb:bucket_padding_share"].samples}
    computed = {s.labels["bucket"]: s.value for s in families["nb:bucket_computed_tokens"].samples}
    assert {s.labels["model_name"] for f in families.values() for s in f.samples} == {"tiny"}
    engine = SimpleNamespace(
        stats=replay.stats, draft_stats={}, pool=replay.pool, spec_stats=SpecDecodeStats(),
        kv_cache=replay.kv, adapters=SimpleNamespace(requests={}, swaps=0),
    )
    print_stats(engine)
    table = capsys.readouterr().err
    assert "computed tokens" in table and "padding share" in table
    assert f"KV cache: {replay.kv.num_preemptions} preemptions" in table
    for b in packed["per_bucket"]:
        assert b["padding_share"] == (b["computed_tokens"] - b["real_tokens"]) / b["computed_tokens"]
        assert share[b["bucket"]] == pytest.approx(b["padding_share"])
        assert computed[b["bucket"]] == b["computed_tokens"] == b["padded_tokens"]
        cells = (b["bucket"], b["calls"], b["real_tokens"], b["computed_tokens"])
        row = " ".join(map(str, cells)) + f" {100 * b['padding_share']:.1f}%"
        assert row in " ".join(re.sub(r"[│┃|]", " ", table).split())
    total = sum(computed.values())
    assert packed["padding_share"] == pytest.approx((total - packed["real_tokens"]) / total)
    title = plot_title(doc["prefill"], doc["refused"], "default.toml")
    assert f"padding share {100 * doc['prefill']['padding_share']:.1f}% of computed tokens" in title


def test_a_plan_with_a_config_keeps_its_max_model_len_and_says_so_when_asked_otherwise() -> None:
    from tests.conftest import error_line

    line = error_line(nb("plan", "--trace", CONV, DEFAULT, "--graphs", 3, "--max-model-len", 512))
    assert "cache.max_model_len (256) bounds the plan; change it in the config" in line
