"""The OpenAI fields agents and evaluation harnesses need, through ``nb serve`` with the official
``openai`` client: logprobs (checked against transformers' log-softmax) and ``n`` choices.
"""

from __future__ import annotations

import openai
import pytest
import torch

from neuron_buckets.engine.llm_engine import LLMEngine
from tests.conftest import tiny_tokenizer
from tests.test_serve import MODEL, client, serving

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]
TOP = 5
SAMPLED = {"temperature": 1.0, "seed": 11}


@pytest.fixture(scope="module")
def server(text_artifact):
    engine = LLMEngine.open(text_artifact)
    with serving(engine) as base:
        yield engine, client(base)


@pytest.fixture(scope="module")
def oracle(text_model):
    """The log-softmax of transformers' logits at each generated position of ``prompt + generated``."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(text_model[0]).eval()

    def logprobs(prompt: list[int], generated: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0].float()
        return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)].log_softmax(dim=-1)

    return logprobs


def check_top_entries(entries: dict[str, float], expected: torch.Tensor, token: int) -> None:
    """A completions ``top_logprobs`` entry: the top ``TOP`` of ``expected`` (one position's
    log-softmax) and ``token``, the one it scores, each under its text."""
    text = tiny_tokenizer().decode
    listed = {*expected.topk(TOP).indices.tolist(), token}
    names = [text([t]) for t in listed]
    assert len(entries) == len(set(names))
    for t, name in zip(listed, names, strict=True):
        if names.count(name) == 1:  # two ids of one text (a split character) share a key
            assert entries[name] == pytest.approx(float(expected[t]), abs=1e-4)


def completion(c, prompt: list[int] | str, **params):
    extra = {"return_token_ids": True, "top_k": params.pop("top_k", 0)}
    params.setdefault("max_tokens", 10)
    return c.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **params)


@pytest.mark.parametrize("params", [{"temperature": 0}, SAMPLED], ids=["greedy", "seeded"])
def test_completion_logprobs_are_transformers_log_softmax_of_emitted_and_top_tokens(server, oracle, params):
    _, c = server
    prompt = [0, *tiny_tokenizer().encode("hello world", add_special_tokens=False)]
    choice = completion(c, prompt, logprobs=TOP, **params).choices[0]
    ids = choice.token_ids
    expected = oracle(prompt, ids)
    emitted = expected.gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert choice.logprobs.token_logprobs == pytest.approx(emitted.tolist(), abs=1e-4)
    if not params["temperature"]:
        assert ids == expected.argmax(dim=-1).tolist()
    text = tiny_tokenizer().decode
    assert choice.logprobs.tokens == [text([t]) for t in ids]
    for j, entries in enumerate(choice.logprobs.top_logprobs):
        check_top_entries(entries, expected[j], ids[j])
    streamed = completion(c, prompt, logprobs=TOP, stream=True, **params)
    chunks = [chunk.choices[0].logprobs for chunk in streamed if chunk.choices and chunk.choices[0].logprobs]
    assert [v for lp in chunks for v in lp.token_logprobs] == choice.logprobs.token_logprobs
    offsets = [o for lp in chunks for o in lp.text_offset]
    tokens = choice.logprobs.tokens
    assert offsets == choice.logprobs.text_offset == [len("".join(tokens[:j])) for j in range(len(ids))]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_list_the_top_tokens_in_order_streamed_or_not(server, oracle, stream):
    engine, c = server
    messages = [{"role": "user", "content": "hello world"}]
    prompt = engine.tokenizer.apply_chat_template(messages)
    ids = completion(c, prompt, **SAMPLED).choices[0].token_ids  # the same seed: the same tokens
    expected = oracle(prompt, ids)
    out = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, logprobs=True, top_logprobs=TOP, stream=stream,
        **SAMPLED,
    )
    if stream:
        content = [e for chunk in out if chunk.choices and chunk.choices[0].logprobs
                   for e in chunk.choices[0].logprobs.content]
    else:
        content = out.choices[0].logprobs.content
    assert len(content) == len(ids)
    emitted = expected.gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert [e.logprob for e in content] == pytest.approx(emitted.tolist(), abs=1e-4)
    values = expected.topk(TOP, dim=-1).values
    for entry, row in zip(content, values.tolist(), strict=True):
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_n_choices_share_one_prefill_and_each_is_seeded_from_the_request_seed(server):
    engine, c = server
    prompt = [3 + (i * 7) % 250 for i in range(21)]  # two full blocks of 8, and 5 tokens; new to the cache
    queries, hits = engine.pool.queries, engine.pool.hits
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 6}
    first = completion(c, prompt, n=4, **params)
    assert [ch.index for ch in first.choices] == [0, 1, 2, 3]
    # four lookups of the prompt, three of which found its two full blocks: computed once
    assert (engine.pool.queries - queries, engine.pool.hits - hits) == (4 * 21, 3 * 2 * 8)
    assert first.usage.prompt_tokens == 21
    assert first.usage.completion_tokens == sum(len(ch.token_ids) for ch in first.choices)
    again = completion(c, prompt, n=4, **params)
    assert [ch.token_ids for ch in again.choices] == [ch.token_ids for ch in first.choices]
    assert len({tuple(ch.token_ids) for ch in first.choices}) > 1
    for i in (0, 2):  # choice i is the request seeded with seed + i
        alone = completion(c, prompt, **{**params, "seed": 5 + i}).choices[0]
        assert alone.token_ids == first.choices[i].token_ids
    streamed = completion(c, prompt, n=4, stream=True, **params)
    tokens: dict[int, list[int]] = {}
    for chunk in streamed:
        for ch in chunk.choices:
            tokens.setdefault(ch.index, []).extend(ch.token_ids or [])
    assert [tokens[i] for i in range(4)] == [ch.token_ids for ch in first.choices]


def test_best_of_returns_the_n_choices_of_highest_mean_logprob(server):
    _, c = server
    prompt = [5 + (i * 11) % 240 for i in range(9)]
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 6}
    runs = completion(c, prompt, n=4, logprobs=0, **params).choices
    mean = {tuple(ch.token_ids): sum(ch.logprobs.token_logprobs) / len(ch.token_ids) for ch in runs}
    best = completion(c, prompt, n=2, best_of=4, **params).choices
    assert [tuple(ch.token_ids) for ch in best] == sorted(mean, key=mean.get, reverse=True)[:2]
    assert [ch.index for ch in best] == [0, 1] and all(ch.logprobs is None for ch in best)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_as_transformers_does(server, oracle, stream):
    """lm-eval's loglikelihood request: the prompt back with its tokens' logprobs, nothing generated."""
    engine, c = server
    text = "the quick brown fox jumps"
    prompt = engine.tokenizer.encode(text)  # with the tokenizer's BOS, as the server encodes it
    expected = oracle(prompt[:1], prompt[1:])  # row j scores prompt token j + 1
    out = completion(c, text, echo=True, max_tokens=0, logprobs=TOP, stream=stream)
    if stream:
        chunks = [chunk for chunk in out if chunk.choices]
        assert len(chunks) == 1
        (choice,) = chunks[0].choices
    else:
        (choice,) = out.choices
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 0)
    assert choice.text == text and choice.token_ids == [] and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tiny_tokenizer().decode([t]) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first
    scored = expected.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert lp.token_logprobs[1:] == pytest.approx(scored.tolist(), abs=1e-4)
    for j, entries in enumerate(lp.top_logprobs[1:]):
        check_top_entries(entries, expected[j], prompt[j + 1])


def test_echo_puts_the_prompt_and_its_logprobs_before_a_seeded_completion(server, oracle):
    _, c = server
    prompt = [0, *tiny_tokenizer().encode("hello world", add_special_tokens=False)]
    plain = completion(c, prompt, logprobs=TOP, **SAMPLED).choices[0]
    echoed = completion(c, prompt, logprobs=TOP, echo=True, **SAMPLED).choices[0]
    assert echoed.token_ids == plain.token_ids  # the same seed: the same tokens
    name = tiny_tokenizer().decode
    assert echoed.text == name(prompt) + plain.text
    lp, n = echoed.logprobs, len(prompt)
    assert lp.tokens == [name([t]) for t in prompt] + plain.logprobs.tokens
    # the plain request shared the prompt's cached blocks, this one computed them: rounding differs
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    expected = oracle(prompt[:1], prompt[1:] + plain.token_ids)  # the prompt's and the completion's rows
    scored = expected.gather(-1, torch.tensor(prompt[1:] + plain.token_ids)[:, None])[:, 0]
    assert lp.token_logprobs[1:] == pytest.approx(scored.tolist(), abs=1e-4)
    assert lp.text_offset == [len("".join(lp.tokens[:j])) for j in range(len(lp.tokens))]
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 generates nothing"):
        completion(c, prompt, max_tokens=0)
