"""``nb serve`` over a compiled tiny model, called as users call it: the official ``openai`` client,
plain HTTP and the command line. Servers listen on 127.0.0.1 at an ephemeral port and are stopped
by each test; nothing here waits on a clock except for things that must happen eventually.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from neuron_buckets.cli import app
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.server.api_server import ServerLimits, create_app
from neuron_buckets.server.engine_loop import RequestStream, deliver_step
from tests.conftest import error_line

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]
MODEL = "tiny"


class PausableEngine:
    """The real engine, whose steps a test can hold back; commands (adds, aborts) still run.

    It records, for each abort, how many steps had run and how many blocks were free right after.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.running = True
        self.lock = threading.Lock()
        self.steps = 0
        self.aborts: list[tuple[int, int]] = []
        self.aborted = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def step(self):
        with self.lock:
            if self.running:
                self.steps += 1
                return self.engine.step()
        time.sleep(0.001)  # paused: let the loop run commands without spinning a core flat out
        return []

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self.aborts.append((self.steps, self.engine.pool.num_free))
        self.aborted.set()

    def pause(self) -> int:
        """Hold back steps; none is running when this returns. The steps run so far."""
        with self.lock:
            self.running = False
            return self.steps

    def resume(self) -> None:
        with self.lock:
            self.running = True


def eventually(check, what: str, timeout: float = 60.0) -> None:
    """Wait for ``check()`` to hold; a liveness bound, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def start_server(engine, limits: ServerLimits | None = None) -> tuple[uvicorn.Server, threading.Thread, str]:
    """A uvicorn server on a thread at an ephemeral port of 127.0.0.1: server, thread, base URL."""
    app = create_app(engine, MODEL, limits or ServerLimits())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started or not thread.is_alive(), "the server started")
    assert server.started, "the server did not start"
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@contextmanager
def serving(engine, limits: ServerLimits | None = None) -> Iterator[str]:
    """A server for the ``with`` block; its base URL."""
    server, thread, base = start_server(engine, limits)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(60)


def post(url: str, body: dict | bytes) -> tuple[int, dict]:
    """Status and JSON body of a POST, error statuses included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric_samples(base: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, frozenset], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def nb_generate(directory: Path, *args: str) -> str:
    result = CliRunner().invoke(app, ["generate", str(directory), *args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def engine(compiled_dir: Path) -> LLMEngine:
    """The tiny model without a tokenizer: prompts are token ids."""
    return LLMEngine.open(compiled_dir)


def test_64_concurrent_streams_all_complete_waiting_for_blocks_and_give_every_block_back(engine):
    lengths = [1 + (i * 37) % 40 for i in range(64)]
    news = [2 + (i * 5) % 8 for i in range(64)]
    prompts = [[10 + (i + j) % 200 for j in range(n)] for i, n in enumerate(lengths)]
    pool = engine.pool
    free, queries = pool.num_free, pool.queries
    assert sum(pool.blocks_for(n + m) for n, m in zip(lengths, news, strict=True)) > free  # some must wait

    async def one(c: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[list[int], str | None]:
        tokens, reason = [], None
        stream = await c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in stream:
            tokens += chunk.choices[0].token_ids
            reason = chunk.choices[0].finish_reason or reason
        return tokens, reason

    async def all_at_once(base: str) -> list[tuple[list[int], str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p, m) for p, m in zip(prompts, news, strict=True)))

    with serving(engine) as base:
        results = asyncio.run(all_at_once(base))
        samples = metric_samples(base)
    assert [len(tokens) for tokens, _ in results] == news
    assert {reason for _, reason in results} == {"length"}
    assert pool.num_free == free
    assert total(samples, "vllm:request_success_total") == 64
    assert total(samples, "vllm:prompt_tokens_total") == sum(lengths)
    assert total(samples, "vllm:generation_tokens_total") == sum(news)
    assert total(samples, "vllm:e2e_request_latency_seconds_count") == 64
    # vLLM's intervals: queued + inference is the whole latency, prefill + decode the inference;
    # some requests waited for blocks, and the inference sum over the run is its mean batch held
    interval = {k: total(samples, f"vllm:request_{k}_time_seconds_sum") for k in
                ("queue", "prefill", "decode", "inference")}
    assert all(total(samples, f"vllm:request_{k}_time_seconds_count") == 64 for k in interval)
    e2e = total(samples, "vllm:e2e_request_latency_seconds_sum")
    assert interval["queue"] + interval["inference"] == pytest.approx(e2e, rel=1e-9)
    assert interval["prefill"] + interval["decode"] == pytest.approx(interval["inference"], rel=1e-9)
    assert interval["queue"] > 0 and interval["decode"] > 0
    assert total(samples, "vllm:num_requests_running") == 0
    calls = total(samples, "nb:bucket_calls_total")
    assert calls == sum(s.calls for s in engine.stats.values()) and calls > 0
    assert total(samples, "nb:engine_steps_total") == engine.step_stats.steps > 0
    step_s, graph_s = (total(samples, f"nb:engine_{k}_seconds_total") for k in ("step", "graph"))
    assert step_s >= graph_s > 0
    # the artifact's default turns prefix caching on: every prompt is looked up once, at admission
    assert total(samples, "vllm:prefix_cache_queries_total") == pool.queries == queries + sum(lengths)
    assert total(samples, "vllm:prefix_cache_hits_total") == pool.hits
    assert total(samples, "vllm:num_preemptions_total") == engine.kv_cache.num_preemptions
    assert total(samples, "vllm:kv_cache_usage_perc") == 0  # every request ended: no block held


def test_a_client_leaving_mid_stream_is_aborted_before_the_next_step(engine):
    paused = PausableEngine(engine)
    free = engine.pool.num_free
    with serving(paused) as base:
        stream = client(base).completions.create(
            model=MODEL, prompt=list(range(10, 30)), max_tokens=100, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert next(iter(stream)).choices[0].token_ids  # generating
        steps = paused.pause()
        stream.close()
        assert paused.aborted.wait(60)
        paused.resume()
        labels = frozenset({("model_name", MODEL), ("finished_reason", "abort")})
        aborted = ("vllm:request_success_total", labels)
        eventually(lambda: metric_samples(base).get(aborted) == 1, "the abort reported")
    assert paused.aborts == [(steps, free)]  # no step ran between the client leaving and the abort


def test_refusals_have_openai_error_bodies_and_the_status_a_client_can_act_on(engine):
    paused = PausableEngine(engine)
    with serving(paused, ServerLimits(max_open_requests=1, max_body_bytes=4096)) as base:
        url = f"{base}/v1/completions"
        status, body = post(url, {"model": MODEL, "prompt": list(range(10, 130)), "max_tokens": 20})
        assert status == 400 and "max_model_len" in body["error"]["message"]
        assert body["error"]["code"] == 400 and body["error"]["type"] == "BadRequestError"
        status, body = post(url, {"model": MODEL, "prompt": [1, 2], "n": 2})
        assert (status, body["error"]["message"]) == (400, "n=2 needs 2 open requests; this server holds "
                                                            "at most 1")
        status, body = post(url, {"model": MODEL, "prompt": [1, 2], "top_p": 0})
        assert status == 400 and "top_p" in body["error"]["message"]
        status, body = post(url, {"model": MODEL, "prompt": "text needs a tokenizer"})
        assert status == 400 and "no tokenizer" in body["error"]["message"]
        status, body = post(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "no tokenizer" in body["error"]["message"]
        status, body = post(url, {"model": "gpt-4", "prompt": [1, 2]})
        assert status == 404 and "gpt-4" in body["error"]["message"]
        status, body = post(url, json.dumps({"model": MODEL, "prompt": [1] * 5000}).encode())
        assert status == 413 and "4096 bytes" in body["error"]["message"]

        paused.pause()  # the one request the limit allows stays open
        held = client(base).completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, stream=True)
        status, body = post(url, {"model": MODEL, "prompt": [1, 2]})
        assert status == 429 and "limit of 1 open requests" in body["error"]["message"]
        paused.resume()
        assert [c.choices[0].finish_reason for c in held][-1] in ("length", "stop")
        status, body = post(url, {"model": MODEL, "prompt": [1, 2], "max_tokens": 2})
        assert status == 200 and body["usage"]["prompt_tokens"] == 2


def test_shutdown_lets_open_streams_finish(engine):
    paused = PausableEngine(engine)
    server, thread, base = start_server(paused)
    stream = client(base).completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=30, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = iter(stream)
    tokens = list(next(chunks).choices[0].token_ids)
    paused.pause()
    server.handle_exit(signal.SIGTERM, None)  # what uvicorn's SIGTERM handler does
    paused.resume()
    tokens += [t for c in chunks for t in c.choices[0].token_ids]
    thread.join(60)
    assert len(tokens) == 30 and not thread.is_alive() and not paused.aborts


def test_nb_serve_serves_until_sigterm_and_finishes_the_open_stream(compiled_dir):
    cmd = [sys.executable, "-m", "neuron_buckets.cli", "serve", str(compiled_dir), "--port", "0",
           "--served-model-name", MODEL]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if m := re.search(r"serving 'tiny' at (http://127\.0\.0\.1:\d+)", line):
                break
        else:
            pytest.fail(f"nb serve exited with {proc.wait()} before listening")
        base = m.group(1)
        assert [m.id for m in client(base).models.list()] == [MODEL]
        stream = client(base).completions.create(
            model=MODEL, prompt=[3, 4, 5], max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        chunks = iter(stream)
        tokens = list(next(chunks).choices[0].token_ids)
        proc.send_signal(signal.SIGTERM)
        tokens += [t for c in chunks for t in c.choices[0].token_ids]
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done
    finally:
        proc.kill()
    assert len(tokens) == 40
    assert "Traceback" not in proc.stderr.read()


def test_nb_serve_refuses_a_directory_that_is_not_an_artifact_in_one_line(tmp_path):
    assert "manifest" in error_line(CliRunner().invoke(app, ["serve", str(tmp_path)]))


def test_completions_and_streamed_chat_give_the_text_nb_generate_gives(text_artifact):  # noqa: F811
    """Greedy and seeded sampling, with and without a stop string: the server's text is the CLI's."""
    prompt, n = "hello world", 12
    sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7}

    def cli(*flags: str, **params) -> str:
        options = [f"--{k.replace('_', '-')}={v}" for k, v in params.items()]
        return nb_generate(text_artifact, "--prompt", prompt, f"--max-new-tokens={n}", *flags, *options)

    with serving(LLMEngine.open(text_artifact)) as base:
        c = client(base)

        def completion(**params) -> str:
            top_k = {"top_k": params.pop("top_k", 0)}
            out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, extra_body=top_k, **params)
            return out.choices[0].text + "\n"

        def chat(**params) -> str:
            top_k = {"top_k": params.pop("top_k", 0)}
            stream = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=n, stream=True,
                extra_body=top_k, **params,
            )
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) + "\n"

        greedy = completion(temperature=0)
        assert greedy.strip() and greedy == cli()
        stop = greedy[-2]  # the greedy text's last character: the request stops at its first one
        assert completion(temperature=0, stop=[stop]) == cli(stop=stop)
        assert completion(**sampled) == cli(**sampled)
        assert chat(temperature=0) == cli("--chat")
        assert chat(**sampled) == cli("--chat", **sampled)


def test_a_failed_step_fails_open_requests_and_health_with_503_but_not_the_server(compiled_dir):
    class Broken(PausableEngine):
        def step(self):
            raise RuntimeError("graph call failed")

    with serving(Broken(LLMEngine.open(compiled_dir))) as base:
        status, body = post(f"{base}/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
        assert status == 503 and "RuntimeError: graph call failed" in body["error"]["message"]
        with pytest.raises(urllib.error.HTTPError, match="503"):
            urllib.request.urlopen(f"{base}/health", timeout=60)
        status, body = post(f"{base}/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
        assert status == 503


def test_nb_serve_refuses_a_port_in_use_in_one_line_before_opening_anything(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = error_line(CliRunner().invoke(app, ["serve", str(tmp_path), "--port", str(port)]))
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_a_steps_outputs_reach_each_open_stream_in_order_with_one_wake_up_of_their_loop():
    loop = asyncio.new_event_loop()
    wake_ups = []
    call_soon_threadsafe = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args: wake_ups.append(args) or call_soon_threadsafe(*args)
    a, gone, b = (RequestStream(loop) for _ in range(3))
    gone.attached = False  # its connection went away: nothing is queued for it

    def output(rid: int, token: int) -> RequestOutput:
        return RequestOutput(rid, [1], [token], [token], "", "", False, None)

    first, second, other, late = output(0, 5), output(0, 6), output(2, 7), output(1, 8)
    try:
        deliver_step([(a, first), (gone, late), (b, other), (a, second)])
        assert len(wake_ups) == 1
        loop.run_until_complete(asyncio.sleep(0))
        got = [a.outputs.get_nowait(), a.outputs.get_nowait(), b.outputs.get_nowait()]
        assert got == [first, second, other]
        assert a.outputs.empty() and b.outputs.empty() and gone.outputs.empty()
    finally:
        loop.close()
