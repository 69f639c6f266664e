"""Where an arriving request's time to first token goes, under a closed loop of streams.

``nb serve``'s engine loop in miniature, in one process, on ``bench_matrix.py``'s artifact for a
shape and dtype (default Llama-3.2-1B in bfloat16): ``--concurrency`` streams, each sending its
next request when its last one ends, as vLLM's load generator does. The server starts its next
step at once when a step ends, before a client's next request can reach it, so a request that
arrives as a step ends joins the engine one step later: that is how arrivals are played here. Each
graph call is timed (``BucketRuntime._run_call`` wrapped) with the plan segments it computes.

A measured request's TTFT (arrival to the end of the step that samples its first token) is cut into:
- **running step**: the step that was already running when it arrived, split by whether it ran a
  prompt's call (another arrival's prefill) or decode rows only;
- **queued, budget**: later steps without its prompt whose chunks and rows filled the step budget or
  its rows (other prompts went first);
- **queued, prefix wait**: later steps without its prompt that had room for it: it was passed over
  (its prefix being computed by another request) or its blocks were short;
- **own steps**: the steps that computed its prompt's chunks, split into the prefill call that held
  the chunk (with decode rows riding in it or not), other calls in those steps (a decode call of
  the rows that did not ride, a second wave), and the rest of the step (sampling, scheduling);
- gaps between steps.
Also printed: prefill calls by how many decode rows rode in them (their mean time), chunks per
prompt, and other prompts packed beside it. Workloads: ``independent`` (random prompts of 225-375
tokens) and ``shared-prefix`` (two 256-token prefixes + 64 own tokens), ``--output-len`` new
tokens each, random token ids. The first ``--warmup`` requests are not measured. Schedules
(``--schedules``): ``fitted`` is the engine's own (a long prompt waits for the next step when
another completes in this one, and a step's last prompt chunk is cut at a token bucket where that
pads less), ``packed`` cuts the same way but packs prompts up to the budget (the engine's rule
before), ``plain`` fills every step to the budget; one engine runs them, in
``--rounds`` alternating runs on the same prompt lengths (other token ids each run, so none
finds another's prompts cached), and each schedule's TTFT against the first's, round by round, is
printed. Each schedule's
breakdown row goes into ``bench/RESULTS.md`` (``--results`` names another file; ``--tiny``
writes ``WORK/RESULTS.md``).

    python -m bench.profile_ttft [--shape llama-3.2-1b --dtype bfloat16 --concurrency 4 --requests 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

from neuron_buckets import LLMEngine, SamplingParams
from neuron_buckets.engine.scheduler import Scheduler
from neuron_buckets.runtime.bucket_runtime import BucketRuntime

from .bench_matrix import matrix_artifact
from .real_models import SHAPES, add_size_args
from .results_table import PROVENANCE, ResultsTable, add_results_argument
from .serve_limits import DTYPE_BYTES
from .workloads import TOKEN_LOW

PARTS = ("running step, a prompt's call", "running step, decode only", "queued, budget",
         "queued, prefix wait", "own: prefill call, riders in it", "own: prefill call, no riders",
         "own: other calls", "own: rest of step", "gaps between steps")
SCHEDULES = ("fitted", "packed", "plain")
TABLE = ResultsTable(
    heading="Where an arrival's TTFT goes (profile_ttft.py)",
    about="""
`bench/profile_ttft.py`: `nb serve`'s engine loop in miniature, in one process, on
`bench_matrix.py`'s artifact: a closed loop of `conc` streams of random-id prompts (`independent`:
225-375 tokens; `shared-prefix`: two 256-token prefixes + 64 own tokens), `out` new tokens each, an
arrival joining the engine after the step that was running. The measured requests' mean TTFT,
cut into where it went: mean seconds (share of the TTFT) of each part. `layers`: the shape's
decoder layers, or fewer (a shallow twin). `schedule`: `fitted` is the engine's own (a prompt
longer than the smallest token bucket waits for the next step when another completes in this one;
a step's last prompt chunk is cut at a token bucket where that pads less), `packed` cuts the same
way but packs prompts up to the budget, `plain` fills every step to the budget; all run on one
engine in `runs` alternating runs each.
""",
    columns=("shape", "layers", "dtype", "workload", "conc", "out", "schedule", "runs", "requests",
             "TTFT mean s", "TTFT p50 s", *(f"{part} s" for part in PARTS), *PROVENANCE),
    key=7,
)


def use_schedule(sched: Scheduler, schedule: str) -> None:
    """Turn a scheduler given the runtime's token buckets (nb's own schedule, ``fitted``) into one of
    ``SCHEDULES``: ``packed`` packs prompts up to the budget, ``plain`` also cuts no step at a bucket.
    The one place that says what each schedule is, for this bench and ``bench_ttft_schedule.py``."""
    if schedule != "fitted":
        sched.pack_limit = None
    if schedule == "plain":
        sched.token_buckets = ()


@dataclass
class StepRecord:
    """One engine step: its wall time, its plan's segments and each graph call's time and parts."""

    start: float
    end: float = 0.0
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (request, tokens, context)
    # (kind, seconds, segments, bucket tokens) of each call
    calls: list[tuple[str, float, list[int], int]] = field(default_factory=list)


@dataclass
class Tracked:
    prompt_len: int
    arrival: float  # when its stream sent it
    added: float  # when the engine took it: between two steps
    first_token: float = 0.0


Run = tuple[dict[int, Tracked], list[StepRecord], float]  # one run's requests, steps and wall seconds


def prompts(workload: str, n: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids: independent 225-375 tokens, or shared-prefix."""
    rng = random.Random(seed)
    high = min(vocab, 49000)
    if workload == "independent":
        return [[rng.randrange(TOKEN_LOW, high) for _ in range(rng.randint(225, 375))] for _ in range(n)]
    prefixes = [[rng.randrange(TOKEN_LOW, high) for _ in range(256)] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(TOKEN_LOW, high) for _ in range(64)] for i in range(n)]


def instrument(runtime: BucketRuntime, steps: list[StepRecord]) -> None:
    """Time every graph call into the step being recorded (the last of ``steps``, which each run
    empties: the runtime is wrapped once)."""
    run_call, run_plan = runtime._run_call, runtime.run_plan

    def timed_plan(plan):
        steps[-1].segments = [(s.request_id, len(s.token_ids), s.context_len) for s in plan]
        return run_plan(plan)

    def timed_call(plan, call):
        start = time.perf_counter()
        out = run_call(plan, call)
        steps[-1].calls.append((call.bucket.kind, time.perf_counter() - start,
                                [p.segment for p in call.parts], call.bucket.tokens))
        return out

    runtime.run_plan, runtime._run_call = timed_plan, timed_call


def drive(engine: LLMEngine, steps: list[StepRecord], work: list[list[int]], concurrency: int, output_len: int
          ) -> dict[int, Tracked]:
    """Play the closed loop; every request's arrival and first token, and every step (into
    ``steps``, the list ``instrument`` records into)."""
    steps.clear()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    tracked: dict[int, Tracked] = {}
    queue = list(reversed(work))

    def add(arrival: float, prompt: list[int]) -> None:
        tracked[engine.add_request(prompt, params)] = Tracked(len(prompt), arrival, time.perf_counter())

    arrived = [(time.perf_counter(), queue.pop()) for _ in range(min(concurrency, len(work)))]
    while engine.has_unfinished or arrived:
        if not engine.has_unfinished:  # an idle engine takes them at once
            for arrival, prompt in arrived:
                add(arrival, prompt)
            arrived = []
        steps.append(StepRecord(time.perf_counter()))
        outputs = engine.step()
        steps[-1].end = now = time.perf_counter()
        for arrival, prompt in arrived:  # they reached the server while this step ran
            add(arrival, prompt)
        arrived = []
        for out in outputs:
            t = tracked[out.request_id]
            if not t.first_token and out.token_ids:
                t.first_token = now
            if out.finished and queue:  # its stream sends the next request now
                arrived.append((now, queue.pop()))
    return tracked


def decode_rows(step: StepRecord, segments: list[int], tracked: dict[int, Tracked]) -> list[int]:
    """Which of ``segments`` are decode rows: their request's context is already past its prompt."""
    return [i for i in segments if step.segments[i][2] >= tracked[step.segments[i][0]].prompt_len]


def breakdown(rid: int, tracked: dict[int, Tracked], steps: list[StepRecord], budget: int, max_rows: int
              ) -> tuple[dict[str, float], dict[str, int]]:
    """One request's TTFT cut into ``PARTS`` (seconds), and counts: its chunks, riders and neighbours."""
    t = tracked[rid]
    parts = dict.fromkeys(PARTS, 0.0)
    counts = {"chunks": 0, "riders": 0, "other prompts packed": 0}
    last_end = t.arrival
    for step in (s for s in steps if s.end > t.arrival and s.start < t.first_token):
        parts["gaps between steps"] += max(0.0, step.start - last_end)
        last_end = step.end
        mine = [i for i, (r, _, ctx) in enumerate(step.segments) if r == rid and ctx < t.prompt_len]
        seconds = step.end - max(step.start, t.arrival)
        if step.start < t.added:
            prompt = any(kind == "prefill" for kind, *_ in step.calls)
            parts["running step, a prompt's call" if prompt else "running step, decode only"] += seconds
        elif not mine:
            tokens = sum(n for _, n, _ in step.segments)
            full = tokens >= budget or len(step.segments) >= max_rows
            parts["queued, budget" if full else "queued, prefix wait"] += seconds
        else:
            counts["chunks"] += len(mine)
            in_calls = 0.0
            for kind, sec, segs, _ in step.calls:
                in_calls += sec
                if kind == "prefill" and set(segs) & set(mine):
                    riders = decode_rows(step, segs, tracked)
                    counts["riders"] += len(riders)
                    counts["other prompts packed"] += len(segs) - len(riders) - len(set(segs) & set(mine))
                    ride = "riders in it" if riders else "no riders"
                    parts[f"own: prefill call, {ride}"] += sec
                else:
                    parts["own: other calls"] += sec
            parts["own: rest of step"] += (step.end - step.start) - in_calls
    parts["gaps between steps"] += max(0.0, t.first_token - last_end)
    return parts, counts


def shifted(work: list[list[int]], run: int, vocab: int) -> list[list[int]]:
    """The same prompt lengths (and shared prefixes) with other token ids for each run, so that no
    run finds an earlier one's prompts in the prefix cache."""
    high = min(vocab, 49000)
    return [[TOKEN_LOW + (t - TOKEN_LOW + 7919 * run) % (high - TOKEN_LOW) for t in p] for p in work]


def main() -> None:
    args = parse_args()
    model, artifact = matrix_artifact(args.models, args.work, args.shape, args.layers, args.dtype)
    engine = LLMEngine(BucketRuntime.open(artifact, preload=True))
    vocab = SHAPES[args.shape].get("vocab_size")
    work = prompts(args.workload, args.warmup + args.requests, vocab, args.seed)
    steps: list[StepRecord] = []
    instrument(engine.runtime, steps)
    fitted, pack_limit = engine.scheduler.token_buckets, engine.scheduler.pack_limit
    budget, max_rows = engine.runtime.buckets.token_budget, engine.runtime.buckets.max_rows
    results: dict[str, list[Run]] = defaultdict(list)
    for r in range(args.rounds):  # the schedules alternate, and take turns going first
        for k, schedule in enumerate(args.schedules[::-1] if r % 2 else args.schedules):
            engine.scheduler.token_buckets, engine.scheduler.pack_limit = fitted, pack_limit
            use_schedule(engine.scheduler, schedule)
            start = time.perf_counter()
            run_work = shifted(work, len(args.schedules) * r + k, vocab)
            tracked = drive(engine, steps, run_work, args.concurrency, args.output_len)
            results[schedule].append((tracked, list(steps), time.perf_counter() - start))
    rows = [report(args, schedule, runs, budget, max_rows) for schedule, runs in results.items()]
    first = args.schedules[0]
    for other in args.schedules[1:]:
        per_round = [statistics.mean(ttfts(f[0], args.warmup)) / statistics.mean(ttfts(o[0], args.warmup))
                     for f, o in zip(results[first], results[other], strict=True)]
        print(f"\nTTFT mean, {first} / {other}, round by round: {', '.join(f'{x:.2f}' for x in per_round)}")
    TABLE.write(args.results, rows)


def ttfts(tracked: dict[int, Tracked], warmup: int) -> list[float]:
    return [tracked[r].first_token - tracked[r].arrival for r in sorted(tracked)[warmup:]]


def report(args: argparse.Namespace, schedule: str, runs: list[Run], budget: int, max_rows: int) -> list[str]:
    """Print one schedule's TTFT breakdown over the measured requests of its runs, and the calls by
    riders and rows; its table row."""
    rows = [breakdown(rid, tracked, steps, budget, max_rows)
            for tracked, steps, _ in runs for rid in sorted(tracked)[args.warmup:]]
    ttft = [t for tracked, _, _ in runs for t in ttfts(tracked, args.warmup)]
    print(f"\n{SHAPES[args.shape].name}, {args.dtype}, {args.workload}, concurrency {args.concurrency}, "
          f"{args.output_len} out, schedule {schedule}; {len(ttft)} requests measured in {len(runs)} runs, "
          f"{args.warmup} before each; {sum(len(s) for _, s, _ in runs)} steps in "
          f"{sum(w for _, _, w in runs):.0f} s; step budget {budget} tokens, {max_rows} rows")
    print(f"TTFT: mean {statistics.mean(ttft):.2f} s, p50 {statistics.median(ttft):.2f} s, "
          f"max {max(ttft):.2f} s")
    print(f"\n{'where the TTFT goes':36s}{'mean s':>8s}{'share':>8s}")
    total = statistics.mean(ttft)
    means = {part: statistics.mean(p[part] for p, _ in rows) for part in PARTS}
    for part, mean in means.items():
        print(f"  {part:34s}{mean:8.2f}{mean / total:8.0%}")
    for key in rows[0][1]:
        print(f"  per request, {key}: mean {statistics.mean(c[key] for _, c in rows):.1f}")
    groups: dict[tuple[str, int, int], list[float]] = defaultdict(list)  # (kind, tokens, decode rows) -> s
    for tracked, steps, _ in runs:
        for step in steps:
            for kind, sec, segs, tokens in step.calls:
                groups[kind, tokens, len(decode_rows(step, segs, tracked))].append(sec)
    print("\ngraph calls by kind, bucket tokens and the decode rows in them (riders, in a prefill call):")
    for (kind, tokens, n), secs in sorted(groups.items()):
        print(f"  {kind:8s}{tokens:5d} tokens, {n} rows: {len(secs):4d} calls, "
              f"mean {statistics.mean(secs) * 1e3:7.0f} ms")
    layers = args.layers or SHAPES[args.shape].num_layers
    return [SHAPES[args.shape].name, str(layers), args.dtype, args.workload, str(args.concurrency),
            str(args.output_len), schedule, str(len(runs)), str(len(ttft)), f"{total:.2f}",
            f"{statistics.median(ttft):.2f}",
            *(f"{mean:.2f} ({mean / total:.0%})" for mean in means.values())]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(p, "nb-bench-matrix", "few requests")
    p.set_defaults(layers=None)
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--workload", choices=["independent", "shared-prefix"], default="independent")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="measured requests")
    p.add_argument("--warmup", type=int, default=4, help="requests before them, not measured")
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES),
                   help="nb's engine, its cut packing prompts to the budget, or steps filled to it")
    p.add_argument("--rounds", type=int, default=2, help="runs of each schedule, alternating")
    add_results_argument(p)
    args = p.parse_args()
    if args.tiny:
        args.layers, args.requests, args.warmup, args.output_len, args.rounds = 2, 6, 2, 8, 1
        args.results = args.work / "RESULTS.md"
    args.work.mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    main()
