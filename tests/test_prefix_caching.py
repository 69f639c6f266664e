"""Prefix caching end to end: requests that share a prefix share its cached blocks, compute only
the rest, and still generate exactly what transformers does, over a NaN-poisoned cache (a block
that was not written, or written for other tokens, would show). The same with caching off.

One eager-backend artifact of the tiny model (block size 8) serves the module. Each case runs
its prompts one wave after another on one engine, so a later wave finds what an earlier one
left cached.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.llm_engine import LLMEngine, generate, prefix_salt
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from tests.conftest import TINY_CONFIG, write_config
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
        assert got == hf_greedy(wave, MAX_NEW)
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
        assert answer == hf_greedy([prompt], MAX_NEW)[0]
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
        engines.append((compiler.keys, LLMEngine(BucketRuntime.open(tmp_path / name / "artifact"))))
    (keys_on, on), (keys_off, off_engine) = engines
    assert keys_on == keys_off  # the same graphs
    assert on.pool.enable_prefix_caching and not off_engine.pool.enable_prefix_caching
    prompt = BASE[:20]
    for engine in (on, off_engine):
        generate(engine, [prompt, prompt], PARAMS)
        generate(engine, [prompt], PARAMS)
    assert on.pool.hits == 16 and (off_engine.pool.queries, off_engine.pool.hits) == (0, 0)
