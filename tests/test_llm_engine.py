"""The step-wise engine: requests that stop early, abort, join between steps, and seeded sampling.

One eager-backend artifact of the tiny model serves the module (no graph compile). Reference
tokens are the engine's own greedy run of a request alone, to its full length; that this equals
transformers' generate is shown in test_engine.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.llm_engine import CacheOwned, LLMEngine, generate
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from tests.conftest import TINY_CONFIG, first_new, write_config
from tests.test_engine import make_prompts

PROMPTS = make_prompts((6, 40, 11), seed=3)  # the 40-token prompt is prefilled in two chunks
FULL = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def artifact(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    tmp = tmp_path_factory.mktemp("eager")
    config = load_config(write_config(tmp, hf_model_dir, TINY_CONFIG.replace('"inductor"', '"eager"')))
    assert not Compiler(config, tmp / "artifact", tmp / "cache").run(jobs=1).failed
    return tmp / "artifact"


@pytest.fixture(scope="module")
def alone(artifact: Path) -> list[list[int]]:
    """Each prompt's 10 greedy tokens, run alone."""
    runtime = BucketRuntime.open(artifact)
    return [generate(runtime, [p], FULL)[0].token_ids for p in PROMPTS]


def engine_of(artifact: Path, **kwargs) -> LLMEngine:
    runtime = BucketRuntime.open(artifact)
    return LLMEngine(runtime, pool=BlockPool(runtime.num_blocks, runtime.block_size), **kwargs)


def test_the_artifact_carries_the_model_directorys_eos_id(artifact):
    assert read_manifest(artifact).text.eos_token_ids == [2]  # generation_config.json of save_pretrained
    assert engine_of(artifact).eos_token_ids == {2}


@pytest.mark.parametrize("how", ["eos", "stop token"])
def test_a_stop_token_ends_a_request_and_frees_its_blocks_at_once(artifact, alone, how):
    k = first_new(alone[0])
    stop = alone[0][k]
    engine = engine_of(artifact, eos_token_ids=[stop] if how == "eos" else [])
    first = SamplingParams(max_tokens=10, stop_token_ids=() if how == "eos" else (stop,))
    a = engine.add_request(PROMPTS[0], first)
    engine.add_request(PROMPTS[2], FULL)
    usable = engine.pool.num_blocks - 1
    ended = []
    while not ended:
        ended = [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.token_ids, o.finish_reason, o.stop_reason) for o in ended] == [
        (a, alone[0][: k + 1], "stop", stop)
    ]
    assert engine.num_running == 1  # the other request goes on, holding only its own blocks
    assert engine.pool.num_free == usable - len(engine.kv_cache.blocks(engine.scheduler.running[0]))
    rest = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [o.token_ids for o in rest] == [alone[2]] and engine.pool.num_free == usable


@pytest.mark.parametrize("how", ["eos", "stop token"])
def test_no_stop_token_ends_a_request_within_min_tokens(artifact, alone, how):
    """The stop id greedy decoding reaches first is masked from its logits until ``min_tokens``
    tokens are out: the request takes the next most likely token there and runs on; with
    ``ignore_eos`` the end-of-sequence id is not masked, so the tokens are those without it."""
    k = first_new(alone[0])
    stop = alone[0][k]
    engine = engine_of(artifact, eos_token_ids=[stop] if how == "eos" else [])
    params = SamplingParams(max_tokens=10, min_tokens=k + 2, stop_token_ids=() if how == "eos" else (stop,))
    out = generate(engine, [PROMPTS[0]], params)[0]
    assert out.token_ids[:k] == alone[0][:k] and out.token_ids[k] != stop
    assert stop not in out.token_ids[: k + 2]
    assert out.finish_reason == "length" or (out.token_ids[-1] == stop and len(out.token_ids) > k + 2)
    if how == "eos":
        ignored = SamplingParams(max_tokens=10, min_tokens=10, ignore_eos=True)
        assert generate(engine, [PROMPTS[0]], ignored)[0].token_ids == alone[0]


def test_abort_frees_the_blocks_at_once_and_is_reported_next_step(artifact, alone):
    engine = engine_of(artifact)
    a, b, _ = (engine.add_request(p, FULL) for p in PROMPTS)
    waiting = engine.add_request([5, 6, 7], FULL)
    engine.step()  # a and b prefill (two rows a step)
    engine.step()  # their decode rows fill the step's two rows: the third prompt and this one wait
    assert engine.num_waiting == 2
    held = next(len(engine.kv_cache.blocks(r)) for r in engine.scheduler.running if r.request_id == a)
    free = engine.pool.num_free
    assert held > 0

    engine.abort(a)
    engine.abort(waiting)
    engine.abort(12345)  # unknown: ignored
    assert engine.pool.num_free == free + held and engine.num_waiting == 1

    reported = {o.request_id: o for o in engine.step()}
    assert (reported[a].finish_reason, reported[waiting].finish_reason) == ("abort", "abort")
    assert reported[a].token_ids == alone[0][: len(reported[a].token_ids)]
    while engine.has_unfinished:
        reported.update((o.request_id, o) for o in engine.step())
    assert reported[b].token_ids == alone[1] and engine.pool.num_free == engine.pool.num_blocks - 1


def test_step_stats_count_the_steps_that_ran_a_plan_and_the_graph_time_inside_them(artifact):
    engine = engine_of(artifact)
    for p in PROMPTS:
        engine.add_request(p, FULL)
    planned = 0
    while engine.has_unfinished:
        planned += engine.scheduler.busy
        engine.step()
    engine.abort(engine.add_request([5, 6, 7], FULL))
    assert not engine.scheduler.busy
    engine.step()  # reports the abort, runs no plan
    stats = engine.step_stats
    assert stats.steps == planned > 0
    assert stats.seconds >= stats.graph_seconds > 0


def test_a_request_added_between_steps_gets_what_it_gets_alone(artifact, alone):
    engine = engine_of(artifact)
    a = engine.add_request(PROMPTS[0], FULL)
    outputs = [o for _ in range(3) for o in engine.step()]
    b = engine.add_request(PROMPTS[2], FULL)
    assert engine.num_waiting == 1
    while engine.has_unfinished:
        outputs += engine.step()
    final = {o.request_id: o.token_ids for o in outputs if o.finished}
    assert final == {a: alone[0], b: alone[2]}
    streamed = [t for o in outputs if o.request_id == a for t in o.new_token_ids]
    assert streamed == alone[0]  # each token reported exactly once, in order


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(artifact):
    mine = SamplingParams(max_tokens=8, temperature=1.0, top_k=40, seed=5, ignore_eos=True)
    others = [FULL, SamplingParams(max_tokens=6, temperature=0.7, seed=9)]
    runtime = BucketRuntime.open(artifact)

    solo = generate(runtime, [PROMPTS[2]], mine)[0].token_ids
    batch = generate(runtime, [PROMPTS[0], PROMPTS[2], PROMPTS[1]], [others[0], mine, others[1]])
    reseeded = generate(runtime, [PROMPTS[2]], SamplingParams(**{**vars(mine), "seed": 6}))[0].token_ids

    assert batch[1].token_ids == solo
    assert reseeded != solo  # the seed, not the prompt alone, decides (8 draws over 40 tokens)


def test_the_old_calls_say_in_one_line_what_to_write_instead(artifact):
    runtime = BucketRuntime.open(artifact)
    line = r"^generate\(\) takes SamplingParams now: pass SamplingParams\(max_tokens=16\)$"
    with pytest.raises(TypeError, match=line):
        generate(runtime, [PROMPTS[0]], 16)
    assert runtime.loaded == []  # refused before anything ran

    out = generate(runtime, [PROMPTS[0]], SamplingParams(max_tokens=2))[0]
    with pytest.raises(AttributeError, match=r"^RequestOutput.tokens is now RequestOutput.token_ids \(the"):
        _ = out.tokens
    with pytest.raises(AttributeError, match=r"^'RequestOutput' object has no attribute 'tokenz'$"):
        _ = out.tokenz
    assert len(out.token_ids) == 2


def test_generate_over_a_runtime_runs_on_its_engine_and_never_overwrites_that_engines_prefix_cache(artifact):
    engine = LLMEngine.open(artifact)
    assert engine.pool.enable_prefix_caching
    p, q = make_prompts((40, 40), seed=11)
    first = generate(engine, [p], FULL)[0].token_ids
    cached = engine.pool.num_cached
    assert cached >= 4  # p's full blocks stay named for the next request that starts with them
    assert generate(engine.runtime, [q], FULL)[0].token_ids == generate(engine, [q], FULL)[0].token_ids
    assert generate(engine, [p], FULL)[0].token_ids == first
    assert engine.pool.hits >= cached * engine.pool.block_size  # p's second run read its cached blocks


def test_a_runtime_has_one_engine_the_newest_and_the_one_it_replaced_refuses_to_run(artifact):
    runtime = BucketRuntime.open(artifact)
    first = LLMEngine(runtime)
    first.add_request(PROMPTS[0], FULL)
    busy = r"^\S+: this runtime's engine still has requests; add these to it \(generate\(engine, \.\.\.\)\), "
    with pytest.raises(CacheOwned, match=busy + "or open another runtime$"):
        LLMEngine(runtime, pool=BlockPool(runtime.num_blocks, runtime.block_size))
    assert runtime.owner is first
    while first.has_unfinished:
        first.step()
    second = LLMEngine(runtime)  # the first one is idle: the newest engine takes the cache
    assert runtime.owner is second
    taken = r"^\S+: a newer engine took this engine's runtime, and its KV cache with it; use that engine$"
    with pytest.raises(CacheOwned, match=taken):
        first.add_request(PROMPTS[0], FULL)
    with pytest.raises(CacheOwned, match=taken):
        generate(first, [PROMPTS[0]], FULL)
    on_runtime = generate(runtime, [PROMPTS[0]], FULL)[0].token_ids  # runs on the runtime's engine
    assert on_runtime == generate(second, [PROMPTS[0]], FULL)[0].token_ids



def test_prompts_cut_at_token_buckets_generate_what_steps_filled_to_the_budget_do(hf_model_dir, tmp_path):
    """Token buckets 8/16/32: an 18-token prompt beside a decode row runs as 15 + the row (16) and
    then 3 + the row (8), not as one call of 32; every greedy token is the same as when each step
    is filled to the budget."""
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    text = TINY_CONFIG.replace('"inductor"', '"eager"').replace("[16, 32]", "[8, 16, 32]")
    config = load_config(write_config(tmp_path, hf_model_dir, text))
    assert not Compiler(config, tmp_path / "artifact", tmp_path / "cache").run(jobs=1).failed
    prompts = make_prompts((5, 18, 7, 21, 19), seed=5)

    def run(fitted: bool) -> tuple[dict[int, list[int]], int]:
        """Each request's tokens, and the steps under the budget that cut a prompt."""
        engine = engine_of(tmp_path / "artifact")
        assert engine.scheduler.token_buckets == (8, 16, 32)
        engine.scheduler.token_buckets = engine.scheduler.token_buckets if fitted else ()
        schedule, plans = engine.scheduler.schedule, []
        engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
        outputs = []
        for prompt in prompts:  # each arrives while the one before it decodes
            engine.add_request(prompt, FULL)
            outputs += [o for _ in range(3) for o in engine.step()]
        while engine.has_unfinished:
            outputs += engine.step()
        cuts = sum(any(s.num_samples == 0 for s in plan) and sum(len(s.token_ids) for s in plan) < 32
                   for plan in plans)
        return {o.request_id: o.token_ids for o in outputs if o.finished}, cuts

    (fitted, cuts), (plain, none) = run(True), run(False)
    assert cuts >= 2 and none == 0
    assert fitted == plain and len(fitted) == len(prompts)
    assert sum(len(tokens) for tokens in fitted.values()) == 10 * len(prompts)
