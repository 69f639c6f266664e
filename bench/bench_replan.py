"""A server that plans its own buckets, measured: it records the traffic it serves, re-plans its token
buckets in the background, swaps them in under load, and serves the same replay with less padding.

The artifact is the embedded default's power-of-two grid (``nb compile`` with no config), or
``--artifact``. The replay is the first ``--requests`` requests of a shipped Azure trace that fit
its ``max_model_len`` (the code trace by default: short prompts, unlike the grid), prompts of
seeded random ids of the trace's lengths, each asking for the trace's output length (greedy,
``ignore_eos``), streamed by ``--concurrency`` clients in a closed loop. Three servers run it:

- **before**: ``nb serve`` on a copy of the artifact as compiled (the old grid);
- **swap**: ``nb serve --replan-every E --replan-budget-s S`` on another copy. Its timer re-plans
  on the traffic recorded so far (the first fire ``E`` s after start-up), compiles the new pieces at
  nice 19 while the load goes on (the batch again from its start, until a minute after the swap),
  and swaps between two steps. Recorded: failed requests, whether every greedy request gives the
  tokens of the **before** run (those in flight at the swap too), each re-plan's outcome, and the
  p99 of the gaps between streamed tokens from the re-plan's start (its child process seen in
  ``/proc``) to the swap against the minute before that start;
- **after**: ``nb serve`` restarted on the swap's copy, which opens its newest version.

**before** and **after** alternate over ``--rounds`` rounds, the order swapped each round: start-up
seconds (process start to ``/health``), output tok/s, and the prefill padding (positions computed
beyond the real tokens, over the real ones, from ``/metrics``), each min / median / max, and the
ratios of the medians. Last, the planner runs offline (``nb replan``'s own choice) on the whole
trace the swap server recorded: the set it picks, and the padding of the swapped set over the
fresh one on the same replayed calls.

    python -m bench.bench_replan [--requests 400] [--concurrency 8] [--replan-every 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from neuron_buckets.artifact.manifest import Manifest, read_manifest
from neuron_buckets.artifact.manifest_versions import newest_complete
from neuron_buckets.replan.artifact_config import config_of
from neuron_buckets.replan.bucket_choice import choose_buckets, served_calls
from neuron_buckets.traffic.padding_stats import padding_stats
from neuron_buckets.traffic.traces import Trace, load_trace

from .profile_serve import scrape
from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument
from .rounds import Spread, add_rounds_argument, run_rounds, spreads
from .servers import free_port, nb_serve_command, serving
from .sse_tokens import token_events

SERVED = "replan"
AFTER_SWAP_S = 60.0  # the swap run's load goes on this long after the swap
KEY = "bench-replan"
TRACES = Path(__file__).parents[1] / "tests" / "data" / "traces"

TABLE = ResultsTable(
    heading="A server that plans its own buckets (bench_replan.py)",
    about="""
`bench/bench_replan.py`: `nb serve` on the embedded default's power-of-two grid replays the first
`requests` servable requests of a shipped Azure trace (random ids of its lengths, greedy, at
`conc` streams). **before**: the old grid; **after**: the server restarted on the version its own
background re-plan wrote; each min / median / max over alternating rounds, ratios of medians.
Padding is prefill positions computed beyond the real tokens, over the real ones. The swap run
re-plans under the same load: its failed requests, whether its greedy tokens equal the before
run's, and the p99 gap between streamed tokens from the re-plan's start to the swap over the
minute before. The fresh plan is the planner's choice on the whole recorded trace; the last
ratio is the swapped set's padding over the fresh set's on the same calls.
""",
    columns=("trace", "requests", "conc", "rounds", "grid before", "grid after", "re-plan outcomes",
             "padding before", "padding after", "padding after / before",
             "tok/s before", "tok/s after", "tok/s after / before",
             "start-up s before", "start-up s after", "failed requests", "greedy tokens as before",
             "p99 token gap ms, during compile / minute before", "p99 during / before",
             "fresh plan grid", "swapped / fresh padding", *PROVENANCE),
    key=3,
    derived={
        "padding after / before": Ratio("padding after", "padding before", suffix=""),
        "tok/s after / before": Ratio("tok/s after", "tok/s before"),
        "p99 during / before": Ratio("p99 token gap ms, during compile / minute before", suffix=""),
    },
)


@dataclass
class Streamed:
    """One request's streamed answer: its token ids and the moment each arrived."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class Run:
    startup_s: float
    wall_s: float
    answers: list[Streamed]
    metrics: dict[tuple[str, str], float]

    @property
    def tok_s(self) -> float:
        return sum(len(a.tokens) for a in self.answers) / self.wall_s

    @property
    def padding(self) -> float:
        """Prefill positions computed beyond the real tokens, over the real ones."""
        real, computed = (sum(v for (name, bucket), v in self.metrics.items()
                              if name == f"nb:bucket_{what}_tokens_total" and bucket.startswith("prefill"))
                          for what in ("real", "computed"))
        return (computed - real) / real


def prompts(trace: Trace, requests: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) of the trace's first ``requests``: seeded random ids of its prompt
    lengths."""
    rng = random.Random(seed)
    return [([rng.randrange(1, vocab) for _ in range(int(p))], int(o))
            for p, o in zip(trace.prompt_lens[:requests], trace.output_lens[:requests], strict=True)]


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Streamed:
    """One greedy streamed answer, each token's arrival stamped; a failed one says why."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    out = Streamed()
    try:
        async for ids in token_events(session, url, body, {"Authorization": f"Bearer {KEY}"}):
            out.tokens += ids
            out.times += [time.monotonic()] * len(ids)
    except (aiohttp.ClientError, RuntimeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def closed_loop(port: int, batch: list[tuple[list[int], int]], concurrency: int,
                      more: Callable[[int], bool]) -> list[Streamed]:
    """``concurrency`` clients send the batch's requests in turn, from the start again after its
    end, while ``more(requests sent)``; each answer at its request's place (its index in the batch
    is its place modulo the batch's length)."""
    answers: list[Streamed] = []
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def client(session: aiohttp.ClientSession) -> None:
        while more(len(answers)):
            answers.append(Streamed())
            i = len(answers) - 1
            prompt, max_tokens = batch[i % len(batch)]
            answers[i] = await stream(session, url, prompt, max_tokens)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return answers


def serve(artifact: Path, batch: list, concurrency: int, log: Path, *flags: str,
          watch: SwapWatch | None = None) -> Run:
    """One server on ``artifact`` (``flags`` added) and the replay through it; ``watch`` follows it."""
    port = free_port()
    cmd = [*nb_serve_command(artifact, port, SERVED), "--api-key", KEY, *flags]
    started = time.monotonic()
    with serving(cmd, dict(os.environ), port, log) as proc:
        startup = time.monotonic() - started
        if watch is not None:
            watch.follow(proc.pid, port)
        begin = time.monotonic()
        more = (lambda sent: sent < len(batch)) if watch is None else watch.more(len(batch))
        answers = asyncio.run(closed_loop(port, batch, concurrency, more))
        wall = time.monotonic() - begin
        metrics = scrape(port)
        if watch is not None:
            watch.finish()
    return Run(startup, wall, answers, metrics)


def fetch(port: int, path: str) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode()


class SwapWatch(threading.Thread):
    """Follows a server through its re-plans: when its ``nb replan`` child first runs (from
    ``/proc``), when it first swaps and the re-plans' outcomes (from ``/metrics``), and at the end
    the trace it recorded."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done, self.pid, self.port = threading.Event(), 0, 0
        self.replan_at: float | None = None
        self.swapped_at: float | None = None
        self.outcomes: dict[str, float] = {}
        self.trace = ""

    def more(self, once: int) -> Callable[[int], bool]:
        """Whether to send another request: the batch once, then on until ``AFTER_SWAP_S`` after the
        swap, or until a re-plan ended without one."""

        def more(sent: int) -> bool:
            if self.swapped_at is not None:
                return time.monotonic() < self.swapped_at + AFTER_SWAP_S
            return sent < once or not self.outcomes

        return more

    def follow(self, pid: int, port: int) -> None:
        self.pid, self.port = pid, port
        self.start()

    def finish(self) -> None:
        self.done.set()
        self.join()
        self.trace = fetch(self.port, "/admin/trace")

    def run(self) -> None:
        while not self.done.wait(0.2):
            now = time.monotonic()
            if self.replan_at is None and any(b"replan" in cmd for cmd in children(self.pid)):
                self.replan_at = now
            families = text_string_to_metric_families(fetch(self.port, "/metrics"))
            samples = [s for fam in families for s in fam.samples]
            self.outcomes = {s.labels["outcome"]: s.value for s in samples
                             if s.name == "nb:replan_runs_total"}
            swaps = sum(s.value for s in samples if s.name == "nb:manifest_swaps_total")
            if self.swapped_at is None and swaps >= 1:
                self.swapped_at = now


def children(pid: int) -> list[bytes]:
    """The command lines of ``pid``'s child processes."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                found.append((proc / "cmdline").read_bytes())
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
    return found


def token_gaps(answers: list[Streamed], start: float, end: float) -> list[float]:
    """Seconds between consecutive streamed tokens of a request, for gaps ending in [start, end)."""
    return [b - a for r in answers for a, b in zip(r.times, r.times[1:], strict=False) if start <= b < end]


def p99_ms(gaps: list[float]) -> float:
    return float(np.percentile(gaps, 99)) * 1e3 if gaps else float("nan")


def spread(s: Spread, fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (s.low, s.median, s.high))


def compile_default(work: Path) -> Path:
    out = work / "default"
    subprocess.run([sys.executable, "-m", "neuron_buckets.cli", "compile", "-o", str(out)], check=True)
    return out


def fresh_plan(artifact: Path, swapped: tuple[int, ...], recorded: Path) -> tuple[tuple[int, ...], float]:
    """The planner's set on the whole recorded trace, and the swapped set's padding over it."""
    config = config_of(read_manifest(artifact))
    trace = load_trace(recorded)
    choice = choose_buckets(config, trace)
    calls = served_calls(config, trace)
    mine = padding_stats(calls, swapped).padded_total
    fresh = padding_stats(calls, choice.chosen).padded_total
    return choice.chosen, (mine - calls.sum()) / max(fresh - calls.sum(), 1)


def prefill_grid(manifest: Manifest) -> tuple[int, ...]:
    return tuple(sorted({b.seq for b in manifest.buckets if b.kind == "prefill"}))


def swap_run(artifact: Path, batch: list, args: argparse.Namespace, log: Path) -> tuple[Run, SwapWatch]:
    """The replay through a server that re-plans on a timer and swaps; exits if it never swapped."""
    watch = SwapWatch()
    run = serve(artifact, batch, args.concurrency, log, "--replan-every", f"{args.replan_every:g}s",
                "--replan-budget-s", str(args.replan_budget_s), watch=watch)
    if watch.swapped_at is None or watch.replan_at is None:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"the server did not swap (re-plans: {watch.outcomes}); its log ends:\n{tail}")
    return run, watch


def figures(run: Run) -> dict[str, dict[str, float]]:
    """One round's figures of a server, for ``rounds.run_rounds`` (the replay is its one cell)."""
    return {"replay": {"padding": run.padding, "tok_s": run.tok_s, "startup_s": run.startup_s}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="artifact to start from (default: embedded default)")
    parser.add_argument("--trace", type=Path, default=TRACES / "AzureLLMInferenceTrace_code.csv")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--replan-every", type=float, default=30.0, help="seconds; the timer's first fire")
    parser.add_argument("--replan-budget-s", type=float, default=600.0)
    add_rounds_argument(parser)
    add_results_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nb-bench-replan-") as tmp:
        work = Path(tmp)
        source = args.artifact or compile_default(work)
        old = read_manifest(source)
        servable = load_trace(args.trace).servable(old.cache.max_model_len)
        batch = prompts(servable, args.requests, old.model.config["vocab_size"])
        dirs = {"before": work / "before", "after": work / "after"}
        for d in dirs.values():
            shutil.copytree(source, d)
        reference = serve(dirs["before"], batch, args.concurrency, work / "reference.log")  # a warm-up too
        swap, watch = swap_run(dirs["after"], batch, args, work / "swap.log")
        new = newest_complete(dirs["after"])[1]
        during = token_gaps(swap.answers, watch.replan_at, watch.swapped_at)
        before = token_gaps(swap.answers, watch.replan_at - 60, watch.replan_at)
        def round_of(name: str, r: int) -> dict[str, dict[str, float]]:
            return figures(serve(dirs[name], batch, args.concurrency, work / f"{name}{r}.log"))

        samples = run_rounds(list(dirs), args.rounds, round_of)
        stats = {n: cells["replay"] for n, cells in spreads(samples).items()}
        recorded = work / "recorded.jsonl"
        recorded.write_text(watch.trace)
        fresh, over_fresh = fresh_plan(source, prefill_grid(new), recorded)
        same = sum(a.tokens == reference.answers[i % len(batch)].tokens for i, a in enumerate(swap.answers))
        failed = sum(a.error is not None for a in swap.answers)
        for name, st in stats.items():
            print(f"{name}: padding {spread(st['padding'], '.3f')}, tok/s {spread(st['tok_s'], '.1f')}")
        row = [args.trace.stem.removeprefix("AzureLLMInferenceTrace_"), str(len(batch)),
               str(args.concurrency), str(args.rounds),
               " ".join(map(str, prefill_grid(old))), " ".join(map(str, prefill_grid(new))),
               ", ".join(f"{k} {v:.0f}" for k, v in sorted(watch.outcomes.items())),
               *(f"{stats[n]['padding'].median:.3f}" for n in dirs),
               *(f"{stats[n]['tok_s'].median:.1f}" for n in dirs),
               *(spread(stats[n]["startup_s"], ".1f") for n in dirs),
               str(failed), f"{same}/{len(swap.answers)}", f"{p99_ms(during):.1f} / {p99_ms(before):.1f}",
               " ".join(map(str, fresh)), f"{over_fresh:.2f}"]
        print(dict(zip(TABLE.columns, row, strict=False)))
        TABLE.write(args.results, [row])


if __name__ == "__main__":
    main()
