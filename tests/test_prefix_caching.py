"""Prefix caching end to end: requests that share a prefix share its cached blocks, compute only
the rest, and still generate exactly what transformers does, over a NaN-poisoned cache (a block
that was not written, or written for other tokens, would show). The same with caching off.

One eager-backend artifact of the tiny model (block size 8) serves the module. Each case runs
its prompts one wave after another on one engine, so a later wave finds what an earlier one
left cached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.llm_engine import LLMEngine, generate, prefix_salt
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.traffic.runtime_replay import prefix_report
from neuron_buckets.traffic.trace_prompts import trace_prompts
from neuron_buckets.traffic.traces import TraceError, load_trace
from tests.conftest import TINY_CONFIG, write_config
from tests.steps_compared import assert_same_tokens
from tests.test_engine import hf_greedy, make_prompts  # noqa: F401  (hf_greedy is a fixture)
from tests.test_llm_engine import artifact  # noqa: F401  (a fixture)

MAX_NEW = 6
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
BASE = make_prompts((30,), seed=7)[0]
OTHER = make_prompts((9,), seed=8)[0]

# name -> (waves of prompts, prompt tokens the later waves find cached)
CASES = {
    "one-block": ([[BASE], [BASE[:8] + OTHER]], 8),
    "several-blocks": ([[BASE], [BASE[:24] + OTHER]], 24),
    "block-and-some": ([[BASE], [BASE[:13] + OTHER]], 8),
    # 17 tokens: two full blocks are cached, and only the last token is computed again
    "whole-prompt": ([[BASE[:17]], [BASE[:17]]], 16),
    # three prompts at once that share a 16-token prefix, after one request that left it cached
    "batch": ([[BASE[:20]], [BASE[:16] + OTHER, BASE[:18], BASE[:16] + OTHER[:3]]], 3 * 16),
    # the same three with nothing cached: the last two wait for the first to write the prefix
    "burst": ([[BASE[:16] + OTHER, BASE[:18], BASE[:16] + OTHER[:3]]], 2 * 16),
}


def poisoned_engine(artifact: Path, enable: bool) -> LLMEngine:  # noqa: F811
    runtime = BucketRuntime.open(artifact)
    runtime.k_cache.fill_(float("nan"))
    runtime.v_cache.fill_(float("nan"))
    pool = BlockPool(runtime.num_blocks, runtime.block_size, enable, prefix_salt(runtime.manifest))
    return LLMEngine(runtime, pool=pool)


@pytest.mark.parametrize("enable", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_prefixes_generate_what_transformers_does(artifact, hf_greedy, case, enable):  # noqa: F811
    waves, hit_tokens = CASES[case]
    engine = poisoned_engine(artifact, enable)
    for wave in waves:
        got = [o.token_ids for o in generate(engine, wave, PARAMS)]
        assert_same_tokens(got, hf_greedy(wave, MAX_NEW), total=len(wave) * MAX_NEW)
    pool = engine.pool
    assert pool.hits == (hit_tokens if enable else 0)
    assert pool.queries == (sum(len(p) for w in waves for p in w) if enable else 0)
    assert pool.num_free == pool.num_blocks - 1  # every block free again, or cached and evictable
    assert (pool.num_cached > 0) == enable


@pytest.mark.parametrize("enable", [True, False], ids=["on", "off"])
def test_a_conversation_reuses_each_earlier_turn(artifact, hf_greedy, enable):  # noqa: F811
    """Each turn's prompt is the last one, its answer and a new message: all but the new message
    and the last partial block come from the cache."""
    engine = poisoned_engine(artifact, enable)
    messages = make_prompts((10, 7, 5, 9), seed=9)
    prompt: list[int] = []
    expected_hits = 0
    for message in messages:
        if prompt:
            expected_hits += (len(prompt) - 1) // 8 * 8  # full blocks; the answer's last token has no K/V
        prompt = prompt + message
        answer = generate(engine, [prompt], PARAMS)[0].token_ids
        assert_same_tokens([answer], hf_greedy([prompt], MAX_NEW), total=MAX_NEW)
        prompt = prompt + answer
    assert engine.pool.hits == (expected_hits if enable else 0)
    assert not enable or engine.pool.hits > 0


def test_the_engine_follows_the_configs_enable_prefix_caching(hf_model_dir, tmp_path):
    """The config's flag reaches the manifest (not the graph keys) and the engine's own pool."""
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    eager = TINY_CONFIG.replace('"inductor"', '"eager"')
    off = eager.replace("max_model_len = 128", "max_model_len = 128\nenable_prefix_caching = false")
    engines = []
    for name, text in (("on", eager), ("off", off)):
        (tmp_path / name).mkdir()
        config = load_config(write_config(tmp_path / name, hf_model_dir, text))
        compiler = Compiler(config, tmp_path / name / "artifact", tmp_path / "cache")
        assert not compiler.run(jobs=1).failed
        engines.append((compiler.plan.keys, LLMEngine(BucketRuntime.open(tmp_path / name / "artifact"))))
    (keys_on, on), (keys_off, off_engine) = engines
    assert keys_on == keys_off  # the same graphs
    assert on.pool.enable_prefix_caching and not off_engine.pool.enable_prefix_caching
    prompt = BASE[:20]
    for engine in (on, off_engine):
        generate(engine, [prompt, prompt], PARAMS)
        generate(engine, [prompt], PARAMS)
    # the second of the pair waits for the first's two blocks, then the third finds them too
    assert on.pool.hits == 32 and (off_engine.pool.queries, off_engine.pool.hits) == (0, 0)


def mooncake_trace(path: Path, requests: int = 200) -> Path:
    """A small synthetic trace in Mooncake's JSONL format, blocks of 16 tokens: four system
    prompts of 1 to 4 blocks, each request adding a block of its own and a few tokens."""
    rows = []
    for i in range(requests):
        shared = [100 * (i % 4) + k for k in range(1 + i % 4)]
        length = 16 * (len(shared) + 1) + i % 7
        hash_ids = [*shared, 1000 + i, 2000 + i]  # as published: one id per (partial) block
        rows.append({"timestamp": 10 * i, "input_length": length, "output_length": 1 + i % 4,
                     "hash_ids": hash_ids[: -(-length // 16)]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_200_requests_of_a_mooncake_trace_replay_with_the_hits_and_calls_the_runtime_counts(
    artifact, hf_model_dir, tmp_path  # noqa: F811
):
    from typer.testing import CliRunner

    from neuron_buckets.cli import app

    trace_file = mooncake_trace(tmp_path / "mooncake.jsonl")
    trace = load_trace(trace_file)
    assert trace.hash_ids is not None and trace.hash_ids[5] == (100, 101, 1005, 2005)
    config = write_config(tmp_path, hf_model_dir, TINY_CONFIG.replace('"inductor"', '"eager"'))
    result = CliRunner().invoke(
        app, ["inspect", "--trace", str(trace_file), str(config), "--json", "--trace-block-size", "16"]
    )
    assert result.exit_code == 0, result.output
    packed = json.loads(result.stdout)["packed"]
    predicted = {b.pop("bucket"): b for b in packed["per_bucket"]}

    engine = LLMEngine(BucketRuntime.open(artifact))  # the artifact's default: caching on
    prompts = trace_prompts(trace.hash_ids, trace.prompt_lens.tolist(), 16)
    params = [SamplingParams(max_tokens=int(o), ignore_eos=True) for o in trace.output_lens]
    generate(engine, prompts, params)
    pool = engine.pool
    measured = {name: s.to_json() for name, s in engine.stats.items() if s.calls}
    assert measured == predicted
    assert packed["prefix_cache"] == prefix_report(pool)
    assert pool.hits > 16 * len(prompts) // 2  # most of the shared system prompts were found
    assert pool.evictions > 0  # 63 blocks are too few to keep every prefix: the replay evicts too


def test_hash_ids_that_are_not_block_ids_are_one_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1, "x"]}\n')
    with pytest.raises(TraceError, match="record 1: hash_ids must be a list of non-negative integers"):
        load_trace(path)
