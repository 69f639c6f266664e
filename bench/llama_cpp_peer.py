"""llama.cpp as a serving peer, on a bfloat16 GGUF of the bench's checkpoint (``gguf_export.py``).

Two ways to serve it, each from outside this project's environment, as vLLM is:

- ``--llama-python VENV/bin/python``: llama-cpp-python's OpenAI server (``python -m
  llama_cpp.server``) from a virtualenv of its own, where ``llama-cpp-python[server]`` was built
  from its source distribution with the machine's CPU flags (``CMAKE_ARGS="-DGGML_NATIVE=ON" pip
  install --no-binary llama-cpp-python 'llama-cpp-python[server]'``). Its server holds one
  ``Llama`` and answers one request at a time: it has no parallel slots, so at concurrency 4 the
  load generator's streams queue in front of it (``interrupt_requests`` off, so none is cut short).
- ``--llama-server BINARY``: llama.cpp's own ``llama-server``, built from the llama.cpp source
  that sdist vendors (``cmake -S vendor/llama.cpp -B build -DGGML_NATIVE=ON && cmake --build build
  --target llama-server``), with ``--parallel`` slots = the concurrency and continuous batching,
  each slot the same context as nb's ``max_model_len``.

Either computes on every core (``n_threads`` and ``n_threads_batch``), with the same batch
(``n_batch``) as the step budget.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ABOUT = 'import importlib.metadata as m; print("llama-cpp-python", m.version("llama-cpp-python"))'


def threads() -> int:
    """The cores this process may run on: what the peer computes on."""
    return len(os.sched_getaffinity(0))


def llama_python_command(python: Path, gguf: Path, port: int, served: str, n_ctx: int, n_batch: int
                         ) -> list[str]:
    """llama-cpp-python's OpenAI server on ``gguf``: one request at a time, every core."""
    n = str(threads())
    return [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", served,
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_batch", str(n_batch),
            "--n_threads", n, "--n_threads_batch", n, "--interrupt_requests", "False", "--seed", "0"]


def llama_server_command(binary: Path, gguf: Path, port: int, served: str, n_ctx: int, n_batch: int,
                         parallel: int) -> list[str]:
    """llama.cpp's ``llama-server`` on ``gguf``: ``parallel`` slots of ``n_ctx`` tokens, every core."""
    n = str(threads())
    return [str(binary), "--model", str(gguf), "--alias", served, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "--ctx-size", str(n_ctx * parallel), "--batch-size", str(n_batch),
            "--threads", n, "--threads-batch", n, "--cont-batching", "--seed", "0"]


def describe(python: Path | None, binary: Path | None, parallel: int) -> str:
    """The peer as a table cell: what runs, its version where pip installed it, its slots and threads."""
    if binary is not None:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        version = (out.stdout + out.stderr).strip().splitlines()[:1]
        return f"llama-server {' '.join(version) or 'unknown version'}, {parallel} slots, {threads()} threads"
    out = subprocess.run([str(python), "-c", ABOUT], capture_output=True, text=True)
    name = out.stdout.strip() if out.returncode == 0 else "llama-cpp-python, unknown version"
    return f"{name} server, one request at a time, {threads()} threads"
