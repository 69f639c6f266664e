"""The opt-in TTFT trace (``engine/ttft_trace.py``): off unless NB_TRACE_TTFT=1, with no route and no
record; on, each served request's parts are non-negative, count what its steps held, and add up
to no more than its time to first token."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from neuron_buckets.core.step_plan import Segment
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.ttft_trace import ENV, TTFTTrace
from tests.test_serve import MODEL, serving

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]


def debug_ttft(base: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{base}/debug/ttft", timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def test_off_by_default_the_engine_keeps_no_trace_and_the_server_has_no_route(
    compiled_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    engine = LLMEngine.open(compiled_dir)
    assert engine.ttft is None and TTFTTrace.from_env() is None
    with serving(engine) as base:
        out = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0).completions.create(
            model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
        assert debug_ttft(base)[0] == 404


def test_on_every_served_request_has_consistent_non_negative_parts(
    compiled_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "1")
    engine = LLMEngine.open(compiled_dir)
    assert isinstance(engine.ttft, TTFTTrace)
    prompts = [[10 + (7 * i + j) % 200 for j in range(20 + 9 * i)] for i in range(8)]

    async def all_at_once(base: str) -> None:
        c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
        await asyncio.gather(*(c.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
                               for p in prompts))

    with serving(engine) as base:
        asyncio.run(all_at_once(base))
        status, report = debug_ttft(base)
    assert status == 200 and report["open"] == 0
    rows = report["requests"]
    assert sorted(r["prompt_len"] for r in rows) == sorted(len(p) for p in prompts)
    for r in rows:
        times = [r["http_ms"], r["queue_ms"], r["wait_ms"], r["host_ms"], *r["prompt_step_ms"]]
        assert min(times) >= 0 and r["wait_steps"] >= 0 and r["decode_rows"] >= 0, r
        assert r["prompt_steps"] == len(r["prompt_step_ms"]) >= 1, r
        assert r["prompt_tokens"] == r["prompt_len"], r  # distinct prompts: none found cached
        parts = r["http_ms"] + r["queue_ms"] + r["wait_ms"] + sum(r["prompt_step_ms"]) + r["host_ms"]
        assert parts <= r["ttft_ms"] + 1e-6 and parts >= 0.99 * r["ttft_ms"] - 1e-3, r
    assert any(r["decode_rows"] > 0 or r["wait_steps"] > 0 for r in rows)  # 8 at once: some met others
    assert set(report["mean"]) >= {"ttft_ms", "queue_ms", "prompt_steps", "decode_rows"}


def test_a_step_is_charged_to_the_prompts_it_computes_and_counts_the_decode_rows_riding() -> None:
    trace = TTFTTrace()
    trace.added(1, 30, received=0.0, submitted=0.0)
    trace.added(2, 10, received=0.0, submitted=0.0)
    decoding = Segment(9, [4], 50, [1], 1)  # a request the trace never saw: already decoding
    chunk = Segment(1, list(range(16)), 0, [2], 0)
    trace.stepped((chunk, decoding), 0.0, [])
    first = RequestOutput(1, [0] * 30, [7], [7], "", "", False, None)
    trace.stepped((Segment(1, list(range(14)), 16, [2], 1), Segment(2, list(range(10)), 0, [3], 1), decoding),
                  0.0, [first])
    [done] = trace.done
    assert (done.prompt_steps, done.prompt_tokens, done.decode_rows, done.wait_steps) == (2, 30, 2, 0)
    assert trace.open[2].prompt_steps == 1 and trace.open[2].wait_steps == 1
    trace.stepped((), 0.0, [RequestOutput(2, [0] * 10, [], [], "", "", True, "abort")])  # no token yet
    assert trace.open == {} and len(trace.done) == 1
