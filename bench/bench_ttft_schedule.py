"""Where an arrival's time to first token goes, in steps and tokens: the scheduler on lengths alone.

No model runs, so the figures are counts and hold on a busy machine. ``nb serve``'s scheduler and
bucket set (the default grid of the matrix's limits, ``bench_matrix.py``) are driven by a closed loop
of ``--concurrency`` streams as ``vllm bench serve`` runs it, arrivals played as the server meets
them (``profile_ttft.py``): a request whose stream's last request ended in step s reaches the
server while step s + 1 runs and joins before step s + 2. Every request generates its full output.
From its arrival to the end of the step that samples its first token, a measured request's time is
cut into the step that was running when it arrived, steps it queued, and its own steps (those that
computed its prompt's chunks), and counted two ways:

- **nb**: what the runtime computes, padding included: the tokens of its prefill calls' buckets
  (decode rows riding in them), and its prefill and decode calls;
- **vLLM**: the same steps as vLLM's scheduler plans them (running requests first, then prompt
  chunks filling ``max_num_batched_tokens``, which is what nb's scheduler does too) computed at
  their real tokens, as vLLM CPU does: it pads no step to a shape. A step with a prompt chunk counts
  its real tokens, decode rows included, and one call; a decode-only step one decode call.

Schedules: ``plain`` fills each step to the token budget whatever the buckets (nb before the step was
cut at its buckets, and vLLM's), ``packed`` cuts a step's last chunk at a token bucket where that
pads less (``Scheduler.fit_buckets``) and packs prompts to the budget (nb before it kept long
prompts apart), ``fitted`` is nb now: that cut, and a prompt longer than the smallest bucket
waits for the next step when another completes in this one (``Scheduler.pack_limit``). A prefill
call costs about its tokens x the prefill token time plus a fixed time (a pass over the weights
and the head, about a decode call), so TTFT is about prefill tokens x the token time + calls
(prefill and decode) x the fixed time: ``profile_ttft.py`` measures both on a model. Workloads as
``profile_ttft.py``'s (random ids, ``independent`` 225-375 tokens, ``shared-prefix``). Rows go to
``bench/RESULTS.md`` (``--results`` names another file).

    python -m bench.bench_ttft_schedule [--concurrency 4 --requests 64]
"""

from __future__ import annotations

import argparse
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from neuron_buckets.config.cache import CacheConfig
from neuron_buckets.config.grid import enumerate_grid
from neuron_buckets.config.loader import parse_config
from neuron_buckets.core.step_plan import StepPlan
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.kv_cache_manager import KVCacheManager
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.scheduler import Scheduler
from neuron_buckets.runtime.bucket_set import BucketSet, Call

from .profile_ttft import SCHEDULES, prompts, use_schedule
from .real_models import SHAPES
from .results_table import PROVENANCE, ResultsTable, add_results_argument
from .serve_limits import ServeLimits

OUTPUT_LEN = {"independent": 100, "shared-prefix": 64}
COUNTS = ("steps, running", "steps, queued", "steps, own", "decode rows in own steps",
          "prefill tokens, running step", "prefill tokens, own steps", "real prompt tokens, own steps",
          "prefill calls", "decode calls")
TABLE = ResultsTable(
    heading="An arrival's TTFT in steps and tokens (bench_ttft_schedule.py)",
    about="""
`bench/bench_ttft_schedule.py`: nb's scheduler and bucket set on lengths alone (no model runs: counts, not
timings), the default grid for the matrix's limits, a closed loop of `conc` streams, an arrival
joining after the step that was running. Per measured request, mean counts from its arrival to its
first token: steps (the running one, queued, its own), decode rows riding in its own steps, prefill
tokens computed (the running step's, its own steps'; nb: its calls' bucket tokens, padding included;
vLLM: real tokens, the same schedule unpadded), its own real prompt tokens, and graph calls.
TTFT is about prefill tokens x the prefill token time + calls x a call's fixed time (about a
decode call's).
`plain`: steps filled to the budget (nb before, and vLLM); `packed`: the last chunk cut at a token
bucket where that pads less, prompts packed to the budget; `fitted` (nb now): that cut, and a prompt
longer than the smallest bucket waits for the next step when another completes in this one.
""",
    columns=("shape", "workload", "conc", "out", "buckets", "requests", "counted as", "schedule", *COUNTS,
             "prefill tokens to first token", *PROVENANCE),
    key=8,
)


@dataclass
class Arrival:
    prompt_len: int
    step: int  # the step running when it reached the server (its first step if none was)
    waited: bool = True  # a step was running when it arrived
    first: int = -1  # the step that sampled its first token
    own: list[int] = field(default_factory=list)  # steps that computed its prompt


@dataclass(frozen=True)
class Step:
    """One step as the runtime lays it out: its plan and calls."""

    plan: StepPlan
    calls: list[Call]


def run(work: list[list[int]], output_len: int, buckets: BucketSet, cache: CacheConfig, concurrency: int,
        schedule: str) -> tuple[list[Arrival], list[Step]]:
    """Play the closed loop through the scheduler; every arrival and every step."""
    kv = KVCacheManager(BlockPool(cache.num_blocks, cache.block_size, cache.enable_prefix_caching))
    sched = Scheduler(kv, buckets.token_budget, buckets.max_rows,
                      token_buckets=[b.seq for b in buckets.prefill], mixed=buckets.mix_decode)
    use_schedule(sched, schedule)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    arrivals: list[Arrival] = []
    requests: dict[int, Request] = {}
    steps: list[Step] = []
    sent, transit = 0, []  # requests sent after a step: they reach the server while the next one runs

    def send() -> Request:
        nonlocal sent
        req = Request(sent, list(work[sent]), len(work[sent]), params)
        arrivals.append(Arrival(len(work[sent]), len(steps)))
        requests[sent], sent = req, sent + 1
        return req

    transit = [send() for _ in range(min(concurrency, len(work)))]
    while sched.busy or transit:
        if not sched.busy:  # an idle engine takes them at once: no step was running
            for req in transit:
                sched.add(req)
                arrivals[req.request_id].waited = False
            transit = []
        plan = sched.schedule()
        steps.append(Step(plan, buckets.calls(plan)))
        s = len(steps) - 1
        for req in transit:  # they arrived while this step ran
            sched.add(req)
        for seg in plan:
            if seg.context_len < kv.prefill_len(requests[seg.request_id]):
                arrivals[seg.request_id].own.append(s)
        touched = sched.commit(plan, [[0] * min(seg.num_samples, 1) for seg in plan])
        transit = []
        for req in touched:
            if arrivals[req.request_id].first < 0:
                arrivals[req.request_id].first = s
            if req.done and sent < len(work):
                transit.append(send())
    return arrivals, steps


def step_counts(step: Step, buckets: BucketSet, padded: bool) -> tuple[int, int, int]:
    """(prefill tokens, prefill calls, decode calls) a step computes: nb's bucket tokens and calls,
    or (vLLM) its real tokens in one pass when it has a prompt chunk, else one decode call."""
    if padded:
        prefill = [c.bucket.seq for c in step.calls if c.bucket.kind == "prefill"]
        return sum(prefill), len(prefill), len(step.calls) - len(prefill)
    if all(buckets.is_decode(s) for s in step.plan):
        return 0, 0, 1
    return sum(len(s.token_ids) for s in step.plan), 1, 0


def breakdown(a: Arrival, steps: list[Step], buckets: BucketSet, padded: bool) -> list[float]:
    """One arrival's ``COUNTS`` and its prefill tokens to first token."""
    own = set(a.own)
    window = range(a.step, a.first + 1)
    counts = dict.fromkeys(COUNTS, 0.0)
    counts["steps, running"] = int(a.waited)
    counts["steps, queued"] = sum(s not in own for s in window) - a.waited
    counts["steps, own"] = len(own)
    prefill_total = 0
    for s in window:
        prefill, prefill_calls, decode = step_counts(steps[s], buckets, padded)
        prefill_total += prefill
        counts["prefill calls"] += prefill_calls
        counts["decode calls"] += decode
        if s == a.step and a.waited:
            counts["prefill tokens, running step"] = prefill
        if s in own:
            counts["prefill tokens, own steps"] += prefill
            counts["decode rows in own steps"] += sum(buckets.is_decode(seg) for seg in steps[s].plan)
    counts["real prompt tokens, own steps"] = a.prompt_len
    return [*counts.values(), prefill_total]


def main() -> None:
    args = parse_args()
    shape = SHAPES[args.shape]
    config = parse_config(tomllib.loads(ServeLimits().nb_config(Path("model"), shape, "bfloat16")))
    buckets = BucketSet.of(enumerate_grid(config))
    sizes = "/".join(str(b.seq) for b in buckets.prefill)
    rows = []
    for workload in args.workloads:
        work = prompts(workload, args.warmup + args.requests, shape.get("vocab_size"), args.seed)
        for schedule in SCHEDULES[::-1]:
            arrivals, steps = run(work, OUTPUT_LEN[workload], buckets, config.cache, args.concurrency,
                                  schedule)
            measured = arrivals[args.warmup:]
            for padded in (True, False) if schedule == "plain" else (True,):
                means = [statistics.mean(col) for col in
                         zip(*(breakdown(a, steps, buckets, padded) for a in measured), strict=True)]
                rows.append([shape.name, workload, str(args.concurrency), str(OUTPUT_LEN[workload]), sizes,
                             str(len(measured)), "nb, padded" if padded else "vLLM, real tokens",
                             schedule, *(f"{m:.1f}" for m in means)])
                print(" | ".join(rows[-1]), flush=True)
    TABLE.write(args.results, rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    p.add_argument("--workloads", nargs="+", choices=list(OUTPUT_LEN), default=list(OUTPUT_LEN))
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=64, help="measured requests")
    p.add_argument("--warmup", type=int, default=8, help="requests before them, not measured")
    p.add_argument("--seed", type=int, default=0)
    add_results_argument(p)
    return p.parse_args()


if __name__ == "__main__":
    main()
