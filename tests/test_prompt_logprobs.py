"""Prompt logprobs: the packed prefill calls return the logits of every prompt token of a request
that asks, through the bucket's own head (no other graph), and they equal transformers' log-softmax.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from neuron_buckets.engine.llm_engine import LLMEngine, generate
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import BucketRuntime

pytestmark = pytest.mark.slow
TOP = 4
# 45 tokens: more than the 32-token budget, so the prompt runs in two steps (a cut chunk, then its end)
LONG = [3 + (i * 37) % 290 for i in range(45)]


@pytest.fixture(scope="module")
def reference(text_model):
    """transformers' log-softmax at every position of ``ids``: row i scores token i + 1."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(text_model[0]).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return logprobs


def check_prompt_logprobs(entries, prompt: list[int], expected: torch.Tensor) -> None:
    """One entry per prompt token, the first None; each the token's logprob and the top ``TOP``."""
    assert len(entries) == len(prompt) and entries[0] is None
    scored = expected[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    assert [e.logprob for e in entries[1:]] == pytest.approx(scored.tolist(), abs=1e-4)
    top = expected[:-1].topk(TOP, dim=-1)
    for e, ids, values in zip(entries[1:], top.indices.tolist(), top.values.tolist(), strict=True):
        assert [t for t, _ in e.top] == ids
        assert [v for _, v in e.top] == pytest.approx(values, abs=1e-4)


def test_prompts_over_several_steps_return_every_logprob_and_sample_as_without(text_artifact, reference):
    engine = LLMEngine.open(text_artifact)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    # The second prompt is packed beside the first one's second chunk and cut there (19 of its 20
    # tokens: every logit a prompt logprob), then its last token samples alone.
    asking = SamplingParams(max_tokens=4, prompt_logprobs=TOP)
    plain, asked = generate(engine, [LONG, LONG[:20]], [params, asking])
    assert plain.prompt_logprobs is None
    check_prompt_logprobs(asked.prompt_logprobs, LONG[:20], reference(LONG[:20]))
    assert asked.token_ids == generate(engine, [LONG[:20]], SamplingParams(max_tokens=4))[0].token_ids
    again = generate(engine, [LONG], replace(params, prompt_logprobs=TOP))[0]
    check_prompt_logprobs(again.prompt_logprobs, LONG, reference(LONG))
    assert again.token_ids == plain.token_ids  # the same seed: asking changes no sampled token


def test_a_request_asking_for_prompt_logprobs_computes_its_cached_prefix_again(text_artifact, reference):
    engine = LLMEngine.open(text_artifact)
    generate(engine, [LONG], SamplingParams(max_tokens=1))  # its full blocks are cached now
    queries, hits = engine.pool.queries, engine.pool.hits
    out = generate(engine, [LONG], SamplingParams(max_tokens=1, prompt_logprobs=TOP))[0]
    assert (engine.pool.queries - queries, engine.pool.hits - hits) == (len(LONG), 0)  # no block shared
    check_prompt_logprobs(out.prompt_logprobs, LONG, reference(LONG))
    generate(engine, [LONG], SamplingParams(max_tokens=1))
    assert engine.pool.hits - hits == 40  # without logprobs the prefix is a hit again: 5 blocks of 8


def test_a_static_head_returns_prompt_logits_in_several_calls_of_its_own_shape(
    text_artifact, reference, monkeypatch: pytest.MonkeyPatch
):
    """On a backend without dynamic shapes (Neuron) the head takes the bucket's sample count: the
    runtime runs it once per group of that many positions, and nothing else changes."""
    runtime = BucketRuntime.open(text_artifact)
    monkeypatch.setattr(runtime.backend, "dynamic_shapes", False)
    head_key = runtime.record(runtime.buckets.prefill[-1]).pieces["head"]
    head, sizes = runtime.graph(head_key), []

    def counted(h, sampling, *weights):
        sizes.append(sampling.numel())
        return head(h, sampling, *weights)

    monkeypatch.setitem(runtime.graphs._graphs, head_key, counted)
    engine = LLMEngine(runtime)
    out = generate(engine, [LONG[:30]], SamplingParams(max_tokens=1, prompt_logprobs=TOP))[0]
    check_prompt_logprobs(out.prompt_logprobs, LONG[:30], reference(LONG[:30]))
    per_call = runtime.buckets.samples(runtime.buckets.prefill[-1])
    assert sizes == [per_call] * -(-30 // per_call)  # 30 logits, in calls of the head's own count
