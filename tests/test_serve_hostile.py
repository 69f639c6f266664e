"""``nb serve`` against hostile clients: the probe's reproductions, each now refused or contained.

One request's bad field or failing step fails that request only; refused requests are refused off
the engine thread; keys, Host names, slow connections and cut streams are handled. Servers listen
on 127.0.0.1 at an ephemeral port; waits are liveness bounds, never timing assertions.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import uvicorn

from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.server.access import ServerAccess
from neuron_buckets.server.api_server import ServerLimits, create_app
from neuron_buckets.server.engine_loop import MAX_COMMANDS, EngineLoop
from neuron_buckets.server.metrics import ServerMetrics
from neuron_buckets.server.slow_clients import HeaderTimeoutH11
from tests.conftest import wait_for_line
from tests.test_serve import MODEL, PausableEngine, eventually, post

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]


class QuickHeaders(HeaderTimeoutH11):
    header_timeout = 0.5


@contextmanager
def serving(engine, limits: ServerLimits | None = None, access: ServerAccess | None = None,
            **config) -> Iterator[tuple[str, uvicorn.Server]]:
    """A server with ``access`` and uvicorn ``config`` for the block: its base URL and itself."""
    app = create_app(engine, MODEL, limits or ServerLimits(), access or ServerAccess())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started or not thread.is_alive(), "the server started")
    assert server.started
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(60)


def get(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def raw_post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def engine(compiled_dir: Path) -> LLMEngine:
    return LLMEngine.open(compiled_dir)


def test_fields_that_would_overflow_inside_a_step_are_refused_by_name_and_the_engine_serves_on(engine):
    """Probe 1 and 11: top_k of 2**63 used to overflow in the sampler and stop the engine loop."""
    with serving(engine) as (base, _):
        url = f"{base}/v1/completions"
        ok = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 1, "ignore_eos": True}
        for field, value in (("top_k", 2**63), ("seed", 2**64), ("stop_token_ids", [2**63])):
            status, body = post(url, {**ok, field: value})
            assert status == 400 and body["error"]["message"].startswith(field), body
        for field, value in (("max_tokens", True), ("prompt", [True, 1]), ("top_k", True)):
            status, body = post(url, {**ok, field: value})
            assert status == 400 and field in body["error"]["message"], body
        edge = {"logprobs": False, "echo": False, "top_k": 2**63 - 1, "seed": 2**64 - 1}
        status, body = post(url, {**ok, **edge})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        status, body = post(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "logprobs": False})
        assert status == 400 and "no tokenizer" in body["error"]["message"]  # logprobs false is "off"
        status, body = post(url, {**ok, "echo": True})  # served: the prompt's ids lead the tokens
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert get(f"{base}/health") == 200


def test_a_bucket_with_a_tampered_graph_fails_its_requests_and_the_others_are_served(compiled_dir, tmp_path):
    """Probe 4: the refused graph used to stop the engine loop, so every bucket got 503."""
    art = tmp_path / "art"
    shutil.copytree(compiled_dir, art, ignore=shutil.ignore_patterns(".nb-lock*"))
    engine = LLMEngine.open(art)
    manifest = engine.runtime.manifest
    key = next(k for k, p in manifest.pieces.items() if p.name == "layer_t32_b2_c0_packed")
    graph = art / manifest.pieces[key].file
    graph.write_bytes(graph.read_bytes()[:-1] + b"!")
    free = engine.pool.num_free
    with serving(engine) as (base, _):
        url = f"{base}/v1/completions"
        status, body = post(url, {"model": MODEL, "prompt": list(range(1, 25)), "max_tokens": 2})  # 24 > 16
        assert status == 500 and "does not match its sha256" in body["error"]["message"], body
        status, body = post(url, {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        assert get(f"{base}/health") == 200
        stream = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0).completions.create(
            model=MODEL, prompt=list(range(1, 25)), max_tokens=2, stream=True)
        with pytest.raises(openai.APIError, match="does not match its sha256"):
            list(stream)
    assert engine.pool.num_free == free


def test_with_an_api_key_v1_needs_it_through_the_official_client_and_health_and_metrics_stay_open(engine):
    with serving(engine, access=ServerAccess(api_key="s3cret")) as (base, _):
        for key in ("wrong", "s3cret-and-more", "s3cre"):
            c = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
        status, body = raw_post(f"{base}/v1/completions", {"model": MODEL, "prompt": [1, 2]}, {})
        assert status == 401 and body["error"]["code"] == 401 and "Bearer" in body["error"]["message"]
        assert get(f"{base}/v1/models") == 401
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        done = c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2
        assert [m.id for m in c.models.list()] == [MODEL]
        assert get(f"{base}/health") == 200 and get(f"{base}/metrics") == 200
    with serving(engine, access=ServerAccess(api_key="k", key_metrics=True)) as (base, _):
        assert get(f"{base}/metrics") == 401
        assert get(f"{base}/metrics", {"Authorization": "Bearer k"}) == 200


def test_a_loopback_server_answers_only_loopback_and_allowed_host_names(engine):
    """Probe 12: DNS rebinding reaches a localhost server under the attacker's name."""
    access = ServerAccess.for_bind("127.0.0.1", None, False, ("box.internal",))
    with serving(engine, access=access) as (base, _):
        port = base.rsplit(":", 1)[1]
        assert get(f"{base}/v1/models", {"Host": f"rebind.attacker.example:{port}"}) == 400
        assert get(f"{base}/health", {"Host": "rebind.attacker.example"}) == 400
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "box.internal"):
            assert get(f"{base}/v1/models", {"Host": host}) == 200, host
    assert ServerAccess.for_bind("0.0.0.0", None, False, ()).allowed_hosts is None


def test_connections_that_trickle_headers_or_a_body_are_closed(engine):
    """Probe 3 (slowloris): partial headers and bodies were held for ever."""
    with serving(engine, ServerLimits(body_timeout_s=0.5), http=QuickHeaders) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            assert s.recv(100) == b""  # closed by the server, not by the 60 s socket timeout
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": [1")
            reply = b""
            while b'"code":408' not in reply and (chunk := s.recv(4096)):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b'"code":408' in reply
        assert get(f"{base}/health") == 200  # whole requests still go through


def test_a_stream_cut_by_the_shutdown_timeout_ends_with_an_error_event(engine, capfd):
    """Probe 11: the cut stream ended in a bare EOF and a CancelledError traceback in the log."""

    class Stalls(PausableEngine):  # two steps, then nothing more until the test resumes it
        def step(self):
            before = self.steps
            out = super().step()
            if before < self.steps == 2:
                self.running = False
            return out

    stalled = Stalls(engine)
    with serving(stalled, timeout_graceful_shutdown=0.5) as (base, server):
        req = urllib.request.Request(
            f"{base}/v1/completions",
            json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 50, "stream": True,
                        "ignore_eos": True, "return_token_ids": True}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            first = resp.readline()
            server.should_exit = True  # what SIGTERM does; nothing finishes the stream in 0.5 s
            events = []
            while not events or "shut down" not in events[-1]:
                if (line := resp.readline().decode()).startswith("data: "):
                    events.append(line)
                assert line, f"the stream ended without an error event: {events}"
        stalled.resume()  # the engine may now drain, so the server can finish stopping
    assert first.startswith(b"data: {") and not any("[DONE]" in e for e in events)
    logged = capfd.readouterr().err
    assert "Cancel 1 running task" in logged and "Traceback" not in logged and "CancelledError" not in logged


def test_the_engine_loop_runs_a_bounded_number_of_commands_between_steps():
    """Probe 2: the command queue was drained without bound before each step."""
    engine = SimpleNamespace(has_unfinished=True, scheduler=SimpleNamespace(waiting=[]))
    loop = EngineLoop(engine, ServerMetrics("m", dict), 10)
    ran: list[int] = []
    for i in range(3 * MAX_COMMANDS):
        loop._commands.put(lambda i=i: ran.append(i))
    loop._drain(block=False)
    assert ran == list(range(MAX_COMMANDS))


def test_text_is_tokenized_off_the_engine_thread_and_bad_text_is_a_400(text_artifact, monkeypatch):
    """Probes 2 and 7: tokenizing ran on the engine thread; a lone surrogate was a 500."""
    threads: list[str] = []
    real = Tokenizer.encode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return real(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", encode)
    with serving(LLMEngine.open(text_artifact)) as (base, _):
        status, body = post(f"{base}/v1/completions", {"prompt": "hello world", "max_tokens": 2})
        assert status == 200
        status, body = post(f"{base}/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2})
        assert status == 400 and "lone surrogate" in body["error"]["message"], body
        chat = {"messages": [{"role": "user", "content": "a\udfffb"}], "max_tokens": 2}
        status, body = post(f"{base}/v1/chat/completions", chat)
        assert status == 400 and "messages[0].content is not valid Unicode" in body["error"]["message"]
    assert threads and not any(name == "nb-engine-loop" for name in threads), threads


def test_nb_serve_warns_once_when_it_listens_beyond_loopback_without_a_key(compiled_dir):
    import signal
    import subprocess
    import sys

    from typer.testing import CliRunner

    from neuron_buckets.cli import app
    from tests.conftest import error_line

    refused = CliRunner().invoke(app, ["serve", "x", "--key-metrics"], env={"NB_API_KEY": None})  # unset
    assert "--key-metrics needs --api-key" in error_line(refused)
    cmd = [sys.executable, "-m", "neuron_buckets.cli", "serve", str(compiled_dir), "--host", "0.0.0.0",
           "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        m, lines = wait_for_line(proc, r"serving .* at http://0\.0\.0\.0:(\d+)")
        warnings = [line for line in lines if "without --api-key" in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/health", timeout=60) as r:
            assert r.status == 200  # any Host is served on a non-loopback bind
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        proc.kill()
    assert "Traceback" not in proc.stderr.read()


def test_failed_accepts_near_the_descriptor_limit_log_one_line_a_minute_without_a_traceback():
    """Probe 3: asyncio logged a traceback per failed accept(), 208 MB in 90 s."""
    import logging

    from neuron_buckets.server.slow_clients import QuietAcceptErrors

    quiet = QuietAcceptErrors()

    def record(message: str) -> logging.LogRecord:
        exc = OSError(24, "Too many open files")
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, (), (OSError, exc, None))

    first = record("socket.accept() out of system resource\nsocket: <socket>")
    assert quiet.filter(first) and first.exc_info is None and "\n" not in first.getMessage()
    assert not any(quiet.filter(record("socket.accept() out of system resource")) for _ in range(1000))
    other = record("Task exception was never retrieved")
    assert quiet.filter(other) and other.exc_info is not None
