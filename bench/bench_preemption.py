"""Blocks on demand against the pool size and the admission watermark, on the scheduler alone.

Requests of 20-token prompts and ``max_tokens`` 200 whose stop token ends them after a few tokens
(5 to 9), as chat traffic sets ``max_tokens`` far above what it generates; with ``--long`` every
fourth request runs to 150 tokens, so the pool runs short and requests are preempted. No model
runs: the scheduler plans every step and commits the stop token at each request's length, as
``nb inspect`` replays a trace. Prints, per pool size and watermark, the steps, the peak and mean
running batch, the preemptions and the tokens computed (recomputed ones included), for each
policy choosing the request to preempt, and writes them into ``bench/RESULTS.md`` (``--results`` names
another file). The figures follow from the scheduler alone, so they change only with the code.

    python -m bench.bench_preemption --num-blocks 40,80 --watermarks 0,0.01,0.05,0.1 [--long]
    python -m bench.bench_preemption --long --num-blocks 24 --policies newest,least-computed,oldest
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.kv_cache_manager import KVCacheManager
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.scheduler import Scheduler

from .results_table import PROVENANCE, ResultsTable, add_results_argument

STOP = 2  # the stop token; every other token generated is 1
TABLE = ResultsTable(
    heading="Preemption policy and watermark (bench_preemption.py)",
    about="""
`bench/bench_preemption.py`: the scheduler alone, no model: requests of 20-token prompts and
`max_tokens` 200 whose stop token ends them after 5-9 tokens (`long`: every fourth runs to 150
tokens, so the pool runs short), block_size 16, a 128-token step budget, through a pool of
`num_blocks` with an admission `watermark` (a share of the pool), for each policy choosing the
request to preempt. Computed: the tokens the steps computed, recomputed ones included.
""",
    columns=("workload", "policy", "num_blocks", "watermark", "steps", "peak running", "mean running",
             "preemptions", "computed", *PROVENANCE),
    key=4,
)


@dataclass(frozen=True)
class Workload:
    requests: int = 16
    prompt_len: int = 20
    max_tokens: int = 200
    long_every: int = 0  # every n-th request runs to ``long_len`` tokens; 0: none
    long_len: int = 150
    block_size: int = 16
    budget: int = 128  # max_num_batched_tokens
    max_rows: int = 4  # max_num_seqs

    def output_len(self, i: int) -> int:
        if self.long_every and i % self.long_every == self.long_every - 1:
            return self.long_len
        return 5 + i % 5  # 5 to 9 tokens, 7 on average

    def describe(self) -> str:
        long = f", every {self.long_every}th to {self.long_len}" if self.long_every else ""
        return f"{self.requests} requests, max_num_seqs {self.max_rows}{long}"


@dataclass(frozen=True)
class Outcome:
    steps: int
    peak_running: int
    mean_running: float
    preemptions: int
    computed: int  # tokens the steps computed, recomputed ones included


class LeastComputed(Scheduler):
    """Preempts the running request with the fewest tokens cached: the least to compute again."""

    def victim(self) -> Request:
        return min(reversed(self.running), key=self.kv.num_cached)


class Oldest(Scheduler):
    """Preempts the first admitted running request."""

    def victim(self) -> Request:
        return self.running[0]


POLICIES = {"newest": Scheduler, "least-computed": LeastComputed, "oldest": Oldest}


def run_workload(work: Workload, num_blocks: int, watermark: float, policy: str = "newest") -> Outcome:
    """Every request to its stop token through the scheduler over a pool of ``num_blocks``."""
    kv = KVCacheManager(BlockPool(num_blocks, work.block_size, enable_prefix_caching=True), watermark)
    sched = POLICIES[policy](kv, work.budget, work.max_rows)
    lengths = {}
    for i in range(work.requests):
        prompt = [100 + i] + [3] * (work.prompt_len - 1)  # no two alike
        params = SamplingParams(max_tokens=work.max_tokens, stop_token_ids=(STOP,))
        sched.add(Request(i, prompt, work.prompt_len, params))
        lengths[i] = work.output_len(i)
    steps, running, computed = 0, [], 0
    while sched.busy:
        plan = sched.schedule()
        steps += 1
        running.append(len(sched.running))
        computed += sum(len(s.token_ids) for s in plan)
        reqs = {r.request_id: r for r in sched.running}
        sampled = []
        for s in plan:
            req = reqs[s.request_id]
            sampled.append([STOP if req.num_generated + 1 >= lengths[s.request_id] else 1][: s.num_samples])
        sched.commit(plan, sampled)
    return Outcome(steps, max(running), sum(running) / len(running), kv.num_preemptions, computed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", default="40,80", help="pool sizes, comma separated")
    parser.add_argument("--watermarks", default="0,0.01,0.05,0.1", help="shares of the pool, comma separated")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-rows", type=int, default=4, help="max_num_seqs")
    parser.add_argument("--policies", default="newest", help=f"comma separated, of {', '.join(POLICIES)}")
    parser.add_argument("--long", action="store_true", help="every fourth request runs to 150 tokens")
    add_results_argument(parser)
    args = parser.parse_args()
    work = Workload(requests=args.requests, long_every=4 if args.long else 0, max_rows=args.max_rows)
    print("policy          num_blocks  watermark  steps  peak running  mean running  preemptions  computed")
    rows = []
    for policy in args.policies.split(","):
        for blocks in (int(b) for b in args.num_blocks.split(",")):
            for mark in (float(w) for w in args.watermarks.split(",")):
                o = run_workload(work, blocks, mark, policy)
                print(f"{policy:<14}  {blocks:>10}  {mark:>9.2f}  {o.steps:>5}  {o.peak_running:>12}"
                      f"  {o.mean_running:>12.2f}  {o.preemptions:>11}  {o.computed:>8}")
                rows.append([work.describe(), policy, str(blocks), f"{mark:.2f}", str(o.steps),
                             str(o.peak_running), f"{o.mean_running:.2f}", str(o.preemptions),
                             str(o.computed)])
    TABLE.write(args.results, rows)


if __name__ == "__main__":
    main()
