"""What ``nb serve`` costs the engine: its step time under HTTP load against the same load in-process.

One closed loop, run two ways over the same artifact (``bench_serve.py``'s SmolLM2-135M-shaped
model with its word tokenizer, ``--layers`` deep, its default grid): ``--concurrency`` streams, each
sending its next request as soon as its last one finished, prompts of 225-375 random token ids
(seeded, the same in both), ``--max-tokens`` new tokens each (greedy, ``ignore_eos``), text
detokenized in both.

- **HTTP**: ``nb serve`` in a process of its own; streamed ``/v1/completions`` (SSE) from an aiohttp
  client in this process, every event read.
- **in-process**: ``LLMEngine`` over the same artifact in this process, stepped in a plain loop that
  adds the next prompt as one finishes. No HTTP, no event loop. The loop runs on a thread of its
  own, as ``nb serve``'s engine loop does. (Before ``BucketRuntime.open`` loaded on a passing
  thread, both ways ran slower than a loop on the opening thread: libgomp's idle pool on the
  opener made the stepping thread's workers sleep between parallel loops; ``utils/passing_thread.py``.)

Both read the engine's own counters (``LLMEngine.step_stats``; ``nb:engine_*`` in ``/metrics``):
steps, wall seconds inside ``step`` and inside its graph calls (``run_plan``). Printed per round:
mean ms per step, ms of graph calls per step, the rest (planning, sampling, detokenization,
outputs), the wall time between steps (a server that holds the engine up between steps shows
there), padded positions per step (the step mix, which should match), CPU ms per step of the
engine's process (every thread), of which the server's event loop, and of the HTTP client (CPU
time barely moves with other processes' load, where wall time swings), and HTTP / in-process of
the step time and of the whole time per step (between steps included). The two alternate
``--rounds`` times after one warm-up round each (graphs load on first use), since a shared
machine's load drifts; the last lines are the medians of the ratios, which go into
``bench/RESULTS.md`` (``--results`` names another file; ``--tiny`` writes ``WORK/RESULTS.md``). Run it
on an idle machine.

    python -m bench.bench_serve_overhead [--layers 4] [--rounds 3] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.sampling_params import SamplingParams

from .bench_serve import GRID, SERVED, bench_model, nb_server, serve_artifact
from .profile_serve import scrape, thread_cpu
from .real_models import add_size_args
from .results_table import PROVENANCE, ResultsTable, add_results_argument
from .servers import free_port
from .sse_tokens import token_events
from .workloads import _random_prompts

TABLE = ResultsTable(
    heading="What nb serve costs the engine (bench_serve_overhead.py)",
    about="""
`bench/bench_serve_overhead.py`: one closed loop of `conc` streams (prompts of 225-375 random ids,
greedy, `new` tokens each, text detokenized) run two ways over the same artifact
(`bench_serve.py`'s SmolLM2-135M-shaped model with its word tokenizer, `layers` deep, its default
grid): through `nb serve` with streamed `/v1/completions` from an aiohttp client, and on an
`LLMEngine` stepped in a plain loop in the bench's process. Both read the engine's own counters:
ms per step inside `step` and per step of wall time (between steps included), medians over the
rounds, which alternate the two ways; ratios are HTTP / in-process, 1 is no cost.
""",
    columns=("layers", "conc", "prompts x new", "rounds", "ms/step HTTP / in-process", "step time ratio",
             "wall ms/step HTTP / in-process", "time per step ratio", "tok/s HTTP / in-process", *PROVENANCE),
    key=3,
)


@dataclass(frozen=True)
class Round:
    """One closed-loop run, by the engine's counters: its steps, their seconds, and its wall time."""

    steps: int
    step_s: float
    graph_s: float
    padded: int  # positions computed in graph calls, real and pad
    wall_s: float
    tokens: int  # generated tokens the client received
    cpu_s: float  # CPU seconds of the engine's process, every thread (OpenMP workers too)
    loop_cpu_s: float = 0.0  # of which the server's main thread: its event loop (HTTP, SSE)
    client_cpu_s: float = 0.0  # CPU seconds of the HTTP client

    def row(self, name: str) -> str:
        n, ms = max(self.steps, 1), 1e3 / max(self.steps, 1)
        return (f"  {name:11s}{self.steps:5d} steps {self.step_s * ms:7.1f} ms/step "
                f"{self.graph_s * ms:7.1f} graph {(self.step_s - self.graph_s) * ms:5.1f} rest "
                f"{(self.wall_s - self.step_s) * ms:5.1f} between {self.padded / n:4.0f} pos/step | CPU "
                f"ms/step {self.cpu_s * ms:6.1f}, event loop {self.loop_cpu_s * ms:4.1f}, client "
                f"{self.client_cpu_s * ms:4.1f} | {self.tokens / self.wall_s:5.1f} tok/s")


def prompts(n: int, seed: int) -> list[list[int]]:
    lengths = [random.Random(seed + i).randint(225, 375) for i in range(n)]
    return _random_prompts(lengths, seed)


def in_process(engine: LLMEngine, batch: list[list[int]], concurrency: int, max_tokens: int) -> Round:
    """The closed loop on the engine itself: up to ``concurrency`` requests open, a finished one
    replaced before the next step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    s0, pos0 = replace(engine.step_stats), padded_total(engine)
    start, cpu0 = time.perf_counter(), time.process_time()
    pending, open_, tokens = iter(batch), set(), 0
    while True:
        while len(open_) < concurrency and (prompt := next(pending, None)) is not None:
            open_.add(engine.add_request(prompt, params))
        if not open_:
            break
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                open_.discard(out.request_id)
    s = engine.step_stats
    return Round(s.steps - s0.steps, s.seconds - s0.seconds, s.graph_seconds - s0.graph_seconds,
                 padded_total(engine) - pos0, time.perf_counter() - start, tokens, time.process_time() - cpu0)


def padded_total(engine: LLMEngine) -> int:
    return sum(s.padded_tokens for s in engine.stats.values())


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> int:
    """One streamed completion read to ``[DONE]``; the tokens it carried."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    return sum([len(ids) async for ids in token_events(session, url, body)])


async def closed_loop(port: int, batch: list[list[int]], concurrency: int, max_tokens: int) -> int:
    queue = iter(batch)
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def client(session: aiohttp.ClientSession) -> int:
        return sum([await stream(session, url, p, max_tokens) for p in queue])

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return sum(await asyncio.gather(*(client(session) for _ in range(concurrency))))


def over_http(server: int, port: int, batch: list[list[int]], concurrency: int, max_tokens: int) -> Round:
    """The closed loop against the server (process id ``server``); its counters from ``/metrics``
    and its threads' CPU time from ``/proc`` around it."""
    m0, cpu0, start, client0 = scrape(port), thread_cpu(server), time.perf_counter(), time.process_time()
    tokens = asyncio.run(closed_loop(port, batch, concurrency, max_tokens))
    wall, client = time.perf_counter() - start, time.process_time() - client0
    m1, cpu1 = scrape(port), thread_cpu(server)
    cpu = {tid: s - cpu0.get(tid, ("", 0.0))[1] for tid, (_, s) in cpu1.items()}

    def delta(name: str) -> float:
        return sum(v - m0.get(k, 0.0) for k, v in m1.items() if k[0] == name)

    return Round(int(delta("nb:engine_steps_total")), delta("nb:engine_step_seconds_total"),
                 delta("nb:engine_graph_seconds_total"), int(delta("nb:bucket_computed_tokens_total")),
                 wall, tokens, sum(cpu.values()), cpu.get(str(server), 0.0), client)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(p, "nb-bench-serve", "one round of 8 prompts")
    p.set_defaults(layers=4)
    p.add_argument("--artifact", type=Path, help="serve this artifact instead of compiling one")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32, help="per round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    add_results_argument(p)
    p.set_defaults(**GRID)  # bench_serve's grid: what serve_artifact reads
    args = p.parse_args()
    if args.tiny:
        args.layers, args.num_prompts, args.rounds, args.results = 2, 8, 1, args.work / "RESULTS.md"
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = parse_args()
    model = bench_model(args.models, args.layers)
    artifact = serve_artifact(args.work, model, args)
    engine = LLMEngine.open(artifact)
    warm = prompts(args.concurrency, seed=1)
    ratios, rounds = [], []
    port = free_port()
    engine_thread = ThreadPoolExecutor(1, thread_name_prefix="nb-engine-loop")

    def local_round(batch: list[list[int]]) -> Round:
        return engine_thread.submit(in_process, engine, batch, args.concurrency, args.max_tokens).result()

    with nb_server(artifact, port, args.work / "overhead-nb-serve.log") as server:
        local_round(warm)
        over_http(server.pid, port, warm, args.concurrency, args.max_tokens)
        print(f"SmolLM2-135M shape, {args.layers} layers, float32; {artifact.name}; closed loop of "
              f"{args.concurrency} streams, {args.num_prompts} prompts of 225-375 tokens, "
              f"{args.max_tokens} new tokens each", flush=True)
        for r in range(args.rounds):
            batch = prompts(args.num_prompts, seed=100 + r)
            if r % 2:  # every other round HTTP first, so a drifting load favours neither
                http = over_http(server.pid, port, batch, args.concurrency, args.max_tokens)
                local = local_round(batch)
            else:
                local = local_round(batch)
                http = over_http(server.pid, port, batch, args.concurrency, args.max_tokens)
            rounds.append((http, local))
            ratios.append(((http.step_s / http.steps) / (local.step_s / local.steps),
                           (http.wall_s / http.steps) / (local.wall_s / local.steps)))
            print(f"round {r + 1}: HTTP / in-process: step time {ratios[-1][0]:.3f}x, time per step "
                  f"{ratios[-1][1]:.3f}x", flush=True)
            print(local.row("in-process"))
            print(http.row("HTTP"), flush=True)
    step, whole = (statistics.median(x) for x in zip(*ratios, strict=True))
    print(f"median over {len(ratios)} rounds, HTTP / in-process: step time {step:.3f}x, "
          f"time per step {whole:.3f}x")

    def pair(figure) -> str:
        return " / ".join(f"{statistics.median(figure(r[i]) for r in rounds):.1f}" for i in (0, 1))

    TABLE.write(args.results, [[
        str(args.layers), str(args.concurrency), f"{args.num_prompts} x {args.max_tokens}", str(len(rounds)),
        pair(lambda r: r.step_s / r.steps * 1e3), f"{step:.3f}x", pair(lambda r: r.wall_s / r.steps * 1e3),
        f"{whole:.3f}x", pair(lambda r: r.tokens / r.wall_s)]])


if __name__ == "__main__":
    main()
