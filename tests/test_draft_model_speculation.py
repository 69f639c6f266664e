"""Draft-model speculation end to end: a second checkpoint compiled into the artifact's draft/,
drafting 3 tokens per target step into its own cache over the target's blocks.

With the target as its own draft every draft must be accepted (the accepted length is k at every
step) and the tokens must be those without speculation; with a different, random draft most
drafts are rejected and the tokens still must not change. Blocks of 8 and rows of 1 + 3 tokens,
so drafts cross block boundaries often; the long prompt is prefilled in two chunks beside the
others' drafted rows.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neuron_buckets.config import ConfigError, load_config
from neuron_buckets.config.draft import DRAFT
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.engine.llm_engine import LLMEngine, generate
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import ArtifactError, BucketRuntime
from tests.conftest import save_tiny_llama, write_config
from tests.steps_compared import assert_same_tokens
from tests.test_engine import EAGER_SPECULATIVE
from tests.test_engine import hf_greedy as hf_greedy  # the transformers oracle fixture
from tests.test_speculative_decoding import PROMPTS, greedy_params, recording

K = 3
DRAFT_SECTION = """
[speculative]
method = "draft_model"
draft_model = "{draft}"
"""


def compile_with_draft(tmp: Path, model: Path, draft: Path, cache: Path):
    from neuron_buckets.compile.compiler import Compiler

    text = EAGER_SPECULATIVE.replace("speculation_length = 2", f"speculation_length = {K}")
    text += DRAFT_SECTION.replace("{draft}", draft.as_posix())
    config = load_config(write_config(tmp, model, text))
    report = Compiler(config, tmp / "artifact", cache).run(jobs=1)
    assert not report.failed
    return config, report


def always_drafting(spec: SpeculativeConfig) -> SpeculativeConfig:
    """The compiled drafter, K drafts per row at run time, every step: these tests check what the
    drafts compute, not whether they pay, which the clock decides (the target drafting for itself
    costs about what it saves)."""
    return replace(spec, num_speculative_tokens=K, auto_off=False)


@pytest.fixture(scope="module")
def graph_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("draft-graph-cache")


@pytest.fixture(scope="module")
def self_draft(hf_model_dir: Path, graph_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """An artifact whose draft is the target's own checkpoint, and the config that built it."""
    tmp = tmp_path_factory.mktemp("self-draft")
    config, report = compile_with_draft(tmp, hf_model_dir, hf_model_dir, graph_cache)
    return BucketRuntime.open(tmp / "artifact"), always_drafting(config.speculative), report


@pytest.fixture(scope="module")
def random_draft(hf_model_dir: Path, graph_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """An artifact whose draft is another random model of the same vocabulary: one layer, narrower."""
    tmp = tmp_path_factory.mktemp("random-draft")
    draft = save_tiny_llama(tmp / "draft-model", seed=7, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    config, _ = compile_with_draft(tmp, hf_model_dir, draft, graph_cache)
    return BucketRuntime.open(tmp / "artifact"), always_drafting(config.speculative)


def off(runtime: BucketRuntime, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in generate(LLMEngine(runtime), prompts, params)]


def assert_every_row_drafts_its_whole_room(plans, params: list[SamplingParams], prompts) -> None:
    """Each decode row carries min(k, tokens still to generate - 1) drafts: the draft model always
    proposes all it may (request ids follow the order the prompts were added)."""
    first = min(s.request_id for p in plans for s in p)
    for s in (s for p in plans for s in p if s.num_samples == len(s.token_ids)):
        i = s.request_id - first
        generated = s.context_len + 1 - len(prompts[i])
        assert len(s.token_ids) - 1 == min(K, params[i].max_tokens - generated - 1)


def test_the_target_as_its_own_draft_accepts_every_draft_and_changes_no_token(self_draft, hf_greedy):
    runtime, spec, _ = self_draft
    params = greedy_params(40, 10, 40)  # the second ends early: the third's chunks run beside drafted rows
    plain = off(runtime, PROMPTS, params)
    engine = LLMEngine(runtime, speculative=spec)
    plans = recording(engine)
    got = [o.token_ids for o in generate(engine, PROMPTS, params)]
    want = [t[: p.max_tokens] for t, p in zip(hf_greedy(PROMPTS, 40), params, strict=True)]
    assert_same_tokens(got, plain, want, total=40 + 10 + 40)
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens  # 100%
    assert stats.acceptance_rate == 1.0
    assert_every_row_drafts_its_whole_room(plans, params, PROMPTS)
    rows = [s for p in plans for s in p if s.num_samples > 1]
    assert sum(len(s.token_ids) == 1 + K for s in rows) >= len(rows) - 3  # k drafts but at each end
    assert stats.mean_accepted_length == 1 + stats.num_draft_tokens / stats.num_drafts
    bs = runtime.block_size
    assert any(s.context_len // bs != (s.end - 1) // bs for s in rows)  # drafts across a block edge
    # packed prefill: the long prompt's second chunk ran in a step beside drafted rows
    assert any(any(s.num_samples > 1 for s in p) and any(s.num_samples <= 1 and len(s.token_ids) > 1
               for s in p) for p in plans)
    draft_stats = engine.drafter.runtime.stats
    assert sum(s.calls for name, s in draft_stats.items() if name.startswith("decode")) > 0


def test_requests_end_mid_draft_with_every_draft_still_accepted(self_draft):
    runtime, spec, _ = self_draft
    plain = off(runtime, PROMPTS, greedy_params(40, 40, 40))
    for lengths in ((1, 2, 3), (5, 6, 7)):
        engine = LLMEngine(runtime, speculative=spec)
        plans = recording(engine)
        params = greedy_params(*lengths)
        got = generate(engine, PROMPTS, params)
        want = [p[:n] for p, n in zip(plain, lengths, strict=True)]
        assert_same_tokens([o.token_ids for o in got], want, total=sum(lengths))
        assert engine.spec_stats.num_accepted_tokens == engine.spec_stats.num_draft_tokens
        assert_every_row_drafts_its_whole_room(plans, params, PROMPTS)
    stops = [p[13] for p in plain]  # a token that an accepted draft carries, not a row's last token
    engine = LLMEngine(runtime, speculative=spec)
    got = generate(engine, PROMPTS, [SamplingParams(max_tokens=40, stop_token_ids=(t,)) for t in stops])
    for o, p, t in zip(got, plain, stops, strict=True):
        assert o.token_ids == p[: p.index(t) + 1] and o.finish_reason == "stop"
    stats = engine.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def poisoned_run(
    runtime: BucketRuntime, spec: SpeculativeConfig, params: list[SamplingParams]
) -> tuple[list[list[int]], LLMEngine]:
    """Generate with both caches NaN before the first step, and after every step NaN in every slot
    the engine does not count as valid: the target's from ``cached`` on, the draft's from
    ``min(draft_cached, cached)`` on (its rejected drafts included). Any read of such a slot turns
    logits to NaN: the target's tokens or the draft's proposals would change."""
    engine = LLMEngine(runtime, speculative=spec)
    draft = engine.drafter.runtime
    caches = [runtime.k_cache, runtime.v_cache, draft.k_cache, draft.v_cache]
    for cache in caches:
        cache.fill_(float("nan"))
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    final, bs, kv = {}, runtime.block_size, engine.kv_cache
    while len(final) < len(ids):
        final.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        for req in engine.scheduler.running:
            for valid, pair in ((kv.num_cached(req), caches[:2]), (kv.draft_context(req), caches[2:])):
                slots = torch.arange(valid, len(kv.blocks(req)) * bs)
                blocks = torch.tensor(kv.blocks(req), dtype=torch.int64)[slots // bs]
                for cache in pair:
                    cache[:, blocks, slots % bs] = float("nan")
    return [final[i] for i in ids], engine


def test_a_poisoned_cache_changes_neither_tokens_nor_acceptance(self_draft, random_draft):
    params = greedy_params(30, 30, 30)
    runtime, spec, _ = self_draft
    tokens, engine = poisoned_run(runtime, spec, params)
    assert_same_tokens(tokens, off(runtime, PROMPTS, params), total=3 * 30)
    assert engine.spec_stats.num_accepted_tokens == engine.spec_stats.num_draft_tokens > 0
    runtime, spec = random_draft
    clean = LLMEngine(runtime, speculative=spec)
    expected = [o.token_ids for o in generate(clean, PROMPTS, params)]
    tokens, engine = poisoned_run(runtime, spec, params)
    assert_same_tokens(tokens, expected, off(runtime, PROMPTS, params), total=3 * 30)
    assert engine.spec_stats == clean.spec_stats  # the draft read no slot it had not computed
    assert engine.spec_stats.num_draft_tokens > engine.spec_stats.num_accepted_tokens


def test_a_different_random_draft_keeps_greedy_tokens_and_counts_its_rejections(random_draft, hf_greedy):
    runtime, spec = random_draft
    params = greedy_params(40, 40, 40)
    engine = LLMEngine(runtime, speculative=spec)
    plans = recording(engine)
    got = [o.token_ids for o in generate(engine, PROMPTS, params)]
    assert_same_tokens(got, off(runtime, PROMPTS, params), hf_greedy(PROMPTS, 40), total=3 * 40)
    stats = engine.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    assert 0 <= stats.acceptance_rate < 1 and 1 <= stats.mean_accepted_length < 1 + K
    assert_every_row_drafts_its_whole_room(plans, params, PROMPTS)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
    once, again = (generate(LLMEngine(runtime, speculative=spec), PROMPTS[:1], [sampled])[0] for _ in "ab")
    assert once.token_ids == again.token_ids and len(once.token_ids) == 20  # a seed still decides


def test_the_draft_is_compiled_into_the_artifact_and_reuses_the_targets_graphs(self_draft):
    runtime, _, report = self_draft
    draft = BucketRuntime.open(runtime.directory / DRAFT)
    assert (draft.block_size, draft.num_blocks, draft.max_model_len) == (
        runtime.block_size, runtime.num_blocks, runtime.max_model_len)
    assert [b.name for b in draft.buckets.decode] == ["decode_b2_c96"]
    assert [b.name for b in draft.buckets.prefill] == [b.name for b in runtime.buckets.prefill]
    target_keys = set(runtime.manifest.pieces)
    reused = [o for o in report.draft.outcomes if o.key in target_keys]
    assert reused and all(o.cached for o in reused)  # the same checkpoint's prefill pieces: cache hits
    # only the draft's decode layer (2 rows of 1 token) is a graph of its own
    assert {o.name for o in report.draft.outcomes if o.key not in target_keys} == {"layer_t2_b2_c96"}


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(hf_model_dir, tmp_path):
    from neuron_buckets.compile.compiler import Compiler

    draft = save_tiny_llama(tmp_path / "other-vocab", vocab_size=128)
    text = EAGER_SPECULATIVE + DRAFT_SECTION.replace("{draft}", draft.as_posix())
    config = load_config(write_config(tmp_path, hf_model_dir, text))
    with pytest.raises(ConfigError, match=r"^speculative.draft_model: .* has vocab_size 128, the target 256; "
                       "a draft model must share the target's vocabulary$"):
        Compiler(config, tmp_path / "artifact", tmp_path / "cache")


def test_an_artifact_without_a_draft_is_refused_in_one_line(random_draft, tmp_path):
    import shutil

    runtime, spec = random_draft
    copy = tmp_path / "no-draft"
    shutil.copytree(runtime.directory, copy, ignore=shutil.ignore_patterns(DRAFT))
    with pytest.raises(ArtifactError, match="no draft model compiled; set .speculative. method = 'draft_"):
        LLMEngine(BucketRuntime.open(copy), speculative=spec)


def test_nb_generate_drafts_with_the_artifacts_draft_model(self_draft):
    from typer.testing import CliRunner

    from neuron_buckets.cli import app
    from tests.conftest import error_line

    runtime, _, _ = self_draft
    args = ["generate", str(runtime.directory), "--prompt-ids", ",".join(map(str, PROMPTS[1])),
            "--max-new-tokens", "21", "--ignore-eos", "--stats"]  # fmt: skip
    plain, spec = (CliRunner().invoke(app, [*args, *extra]) for extra in ([], ["--speculative-draft", "3"]))
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert plain.stdout.splitlines()[0] == spec.stdout.splitlines()[0]
    line = next(line for line in spec.output.splitlines() if line.startswith("speculation:"))
    assert "draft tokens accepted (100%)" in line and "mean accepted length 4.00" in line  # 20 = 5 rows of 4
    assert "draft decode_b2_c96" in spec.output  # the draft's own bucket counters
    both = CliRunner().invoke(app, [*args, "--speculative-draft", "3", "--speculative-ngram", "2"])
    assert error_line(both).startswith("error: --speculative-ngram and --speculative-draft each pick")


def test_nb_inspect_shows_what_speculation_costs_in_graphs_and_compile_time(self_draft, tmp_path):
    import json

    from typer.testing import CliRunner

    from neuron_buckets.artifact.manifest import read_manifest
    from neuron_buckets.cli import app
    from tests.test_traces import CODE

    runtime, _, report = self_draft
    args = ["inspect", "--trace", str(CODE), "--manifest", str(runtime.directory)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    spec = json.loads(result.stdout)["speculation"]
    own = [o for o in report.draft.outcomes if o.key not in runtime.manifest.pieces]
    draft = read_manifest(runtime.directory / DRAFT)
    assert spec["speculation_length"] == K
    assert spec["draft"] == {
        "buckets": 2, "pieces": 1, "shared_pieces": 3, "bytes": sum(draft.pieces[o.key].bytes for o in own),
        "compile_seconds": round(sum(draft.pieces[o.key].compile_seconds for o in own), 3),
        "weights_bytes": draft.weights.bytes,
    }  # fmt: skip
    assert spec["verify"]["pieces"] == 1 and spec["target"]["pieces"] == len(runtime.manifest.pieces)
    rich = CliRunner().invoke(app, args)
    assert "draft model: 2 buckets, 1 pieces of its own" in rich.output.replace("\n", " ")
    config = tmp_path / "nb.toml"
    config.write_text("[buckets]\nspeculation_length = 3\nnum_seqs_buckets = [1, 2, 4]\n[speculative]\n"
                      "method = 'draft_model'\ndraft_model = 'small'\n")
    planned = CliRunner().invoke(app, ["inspect", "--trace", str(CODE), str(config), "--json"])
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.stdout)["speculation"] == {
        "speculation_length": 3, "target_buckets": 7, "verify_buckets": 3, "draft_buckets": 7,
    }  # fmt: skip  # 4 default prefill token buckets (16-128) + 3 decode batch buckets


def test_nb_plan_counts_the_draft_models_graphs_in_the_compile_cost(self_draft, tmp_path):
    """The same plan over the artifact and over a copy without draft/: the draft's graphs of the
    chosen sets (priced from its own manifest) add to the compile seconds."""
    import json
    import shutil

    from typer.testing import CliRunner

    from neuron_buckets.cli import app
    from neuron_buckets.traffic.compile_cost import load_manifest_buckets
    from tests.test_traces import CODE

    runtime, _, _ = self_draft
    alone = tmp_path / "no-draft"
    shutil.copytree(runtime.directory, alone, ignore=shutil.ignore_patterns(DRAFT))
    docs = []
    for artifact in (runtime.directory, alone):
        result = CliRunner().invoke(app, ["plan", "--trace", str(CODE), "--graphs", "2", "--manifest",
                                          str(artifact), "--max-num-seqs", "2", "--json"])  # fmt: skip
        assert result.exit_code == 0, result.output
        docs.append(json.loads(result.stdout))
    with_draft, without = docs
    assert with_draft["prefill"]["buckets"] == without["prefill"]["buckets"]
    cost = load_manifest_buckets(runtime.directory).cost
    assert cost.draft is not None and load_manifest_buckets(alone).cost.draft is None
    buckets, seqs = tuple(with_draft["prefill"]["buckets"]), tuple(with_draft["decode"]["buckets"])
    ctx = tuple(with_draft["context"]["buckets"]) if with_draft["context"] else None
    extra = sum(g.seconds for g in cost.draft.graphs(buckets, (), ctx) + cost.draft.graphs((), seqs, ctx))
    assert extra > 0
    assert with_draft["compile_seconds"] == pytest.approx(without["compile_seconds"] + extra)


def test_nb_compile_builds_the_draft_and_reuses_it_on_the_next_run(hf_model_dir, graph_cache, tmp_path):
    from typer.testing import CliRunner

    from neuron_buckets.cli import app

    text = EAGER_SPECULATIVE.replace("speculation_length = 2", f"speculation_length = {K}")
    text += DRAFT_SECTION.replace("{draft}", hf_model_dir.as_posix())
    config = write_config(tmp_path, hf_model_dir, text)
    args = ["compile", str(config), "--out", str(tmp_path / "artifact"), "--cache-dir", str(graph_cache)]
    dry = CliRunner().invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "decode_b2_c96" in dry.output and "decode_b2_s4_c96" in dry.output  # both grids
    runs = [CliRunner().invoke(app, args) for _ in "ab"]
    assert all(r.exit_code == 0 for r in runs), runs[0].output
    # float32 on a CPU: no fresh layers (compile.fresh_layers unset)
    assert "4 buckets in 8 pieces (2 buckets, 4 pieces the draft's)" in runs[0].output.replace("\n", " ")
    assert "compiled 0, reused 8, failed 0" in runs[1].output  # the draft's pieces are cached too
    assert BucketRuntime.open(tmp_path / "artifact" / DRAFT).buckets.decode_seq == 1
    listing = CliRunner().invoke(app, ["ls", str(tmp_path / "artifact")])
    assert listing.exit_code == 0 and "draft model: 2 buckets in draft/" in listing.output


def test_a_prefix_cache_hit_shares_the_drafts_cache_too(self_draft):
    """The second request shares the first's prompt blocks: the draft prefilled them in the same
    steps as the target, so the draft's K/V there is right and every draft is still accepted."""
    runtime, spec, _ = self_draft
    prefix = PROMPTS[2][:24]  # three full blocks
    prompts = [prefix + [7, 7, 1], prefix + [9, 2]]
    params = greedy_params(20)
    plain = [off(runtime, [p], params)[0] for p in prompts]
    engine = LLMEngine(runtime, speculative=spec)
    got = [[o.token_ids for o in generate(engine, [p], params)][0] for p in prompts]
    assert_same_tokens(got, plain, total=2 * 20)
    assert engine.pool.hits == 24  # the second prompt's three blocks came from the cache
    assert engine.spec_stats.num_accepted_tokens == engine.spec_stats.num_draft_tokens > 0


def test_sampled_tokens_with_a_draft_model_follow_the_targets_distribution():
    """As the n-gram test in test_speculative_decoding.py, with the drafts from a draft model: a
    runtime double of another Markov chain, whose argmax drafts the target half accepts. 2000
    seeded requests of 4 tokens: each token's marginal fits the target chain's exact one."""
    from neuron_buckets.engine.block_pool import BlockPool
    from neuron_buckets.engine.draft_model_drafter import DraftModelDrafter
    from tests.test_speculative_decoding import MarkovRuntime, p_value

    vocab, new = 5, 4
    gen = torch.Generator().manual_seed(0)
    probs = torch.randn(vocab, vocab, generator=gen).softmax(-1)
    target = MarkovRuntime(probs, K)
    draft = MarkovRuntime(torch.randn(vocab, vocab, generator=gen).softmax(-1), 0)
    pool = BlockPool(target.num_blocks, target.block_size)
    engine = LLMEngine(target, pool=pool, speculative=SpeculativeConfig(num_speculative_tokens=K))
    engine.drafter = engine.scheduler.drafter = DraftModelDrafter(draft, engine.kv_cache)  # type: ignore[arg-type]
    params = [SamplingParams(max_tokens=new, temperature=1.0, seed=i) for i in range(2000)]
    tokens = torch.tensor([o.token_ids for o in generate(engine, [[0, 1, 2, 3]] * 2000, params)])
    marginal = torch.eye(vocab)[3]
    for t in range(new):
        marginal = marginal @ probs
        assert p_value(torch.bincount(tokens[:, t], minlength=vocab), marginal) > 0.001, t
    stats = engine.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
