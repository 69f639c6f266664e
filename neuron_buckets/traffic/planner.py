"""Choose bucket sets from traffic: the exact minimum of padded work for at most K graphs.

Powers of two (the vLLM-neuron and NxD default) ignore where prompts actually fall; on the Azure
traces the best 8 buckets pad a fraction of what they do (``bench/bench_plan.py`` prints both).

The optimum is a 1-D dynamic programme. The largest bucket is fixed (it must hold the longest
prompt, or equal the ``max_num_batched_tokens`` cap, beyond which prompts are chunked), and with
buckets on multiples of ``align`` an item of size n is served by the first bucket at or above
ceil(n / align) * align, so only the distinct aligned sizes matter. With c_j those sizes and S_j
the items at or below c_j, the best exactly-k set whose largest bucket is c_j costs
    g_k[j] = min_{i<j} g_{k-1}[i] + c_j (S_j - S_i),   g_1[j] = c_j S_j,
evaluated for all i, j at once per k: O(K m^2) for m distinct sizes (m <= cap / align).

Decode context buckets are the same programme over a different item: every generated token after
the first is one decode row that attends over its request's context so far, and on the smallest
context bucket holding it that costs the bucket's positions. Weighting each context by the
tokens decoded there, the optimum minimises the context positions attended. It is exact for that
per-row cost; the runtime puts rows of similar context in one call, which reads the call's
deepest row's bucket, so calls that mix contexts cost more than the plan counts.

Token buckets for the steps a server runs are the same programme once more, over the packed
calls of a runtime replay (``runtime_replay.py``; a closed loop or the trace's arrivals) instead
of single prompts: ``plan_replayed``. The per-prompt optimum of ``plan`` stays beside it, as what
it is: the best set were every prompt prefilled alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from neuron_buckets.config.buckets import DEFAULT_MAX_NUM_SEQS, default_contexts
from neuron_buckets.core.bucket import powers_of_two
from neuron_buckets.traffic.bucket_plan import BucketPlan, ContextPlan, DecodePlan, ParetoRow, decode_json
from neuron_buckets.traffic.compile_cost import CompileCost
from neuron_buckets.traffic.padding_stats import padding_stats, replay_decode
from neuron_buckets.traffic.traces import Trace

_BLOCK_ELEMENTS = 1 << 22  # bound on the (i, j) slab built per step: 32 MiB of float64
# nb plan's token budget without a config: prompts beyond it run in chunks of it
DEFAULT_TOKEN_BUDGET = 2048
LIGHT_LOAD = (1, 2, 4)  # decode batches of a lightly loaded server: they get graphs of their own


class PlanError(ValueError):
    """Plan options that no bucket set can satisfy."""


@dataclass(frozen=True)
class PlanOptions:
    graphs: int  # at most this many prefill graphs
    align: int = 64  # prefill buckets are multiples of this (e.g. the block size)
    max_num_batched_tokens: int | None = None  # largest prefill bucket allowed; None: no cap
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # decode slots in the replay, the largest num_seqs bucket
    decode_graphs: int | None = None  # None: as many as the powers-of-two num_seqs set
    tokens_per_s: float = 30.0  # per-request decode rate in the replay
    max_compile_seconds: float | None = None  # budget for all graphs (needs a CompileCost)
    holdout_split: float | None = None  # fit on this first fraction by arrival, report the rest
    max_model_len: int | None = None  # largest decode context; None: the longest request, aligned
    context_graphs: int | None = None  # decode context buckets; None: as many as the default set


def powers_of_two_baseline(longest: int, start: int = 128) -> tuple[int, ...]:
    """The default set: start, 2*start, ... up to the first power of two >= the longest prompt."""
    return tuple(powers_of_two(start, max(start, 1 << (int(longest) - 1).bit_length())))


def largest_bucket(longest: int, align: int, cap: int | None) -> int:
    """The aligned bucket holding the longest item, lowered to the aligned cap if it is above."""
    if align < 1:
        raise PlanError(f"align must be >= 1, got {align}")
    top = -(-int(longest) // align) * align
    if cap is not None:
        if cap < align:
            raise PlanError(f"the cap {cap} is below align={align}: no aligned bucket fits")
        top = min(top, cap // align * align)
    return top


def optimal_sets(
    sizes: np.ndarray,
    graphs: int,
    align: int = 1,
    cap: int | None = None,
    weights: np.ndarray | None = None,
) -> list[tuple[int, ...]]:
    """The padding-minimal bucket set with at most k buckets, for every k = 1..graphs."""
    if graphs < 1:
        raise PlanError(f"need at least one graph, got {graphs}")
    sizes = np.asarray(sizes, dtype=np.int64)
    w = np.ones(len(sizes)) if weights is None else np.asarray(weights, dtype=np.float64)
    top = largest_bucket(sizes.max(), align, cap)
    rest = sizes % top  # full chunks of ``top`` pad nothing, whatever the other buckets are
    aligned = -(-rest[rest > 0] // align) * align
    c, inverse = np.unique(np.append(aligned, top), return_inverse=True)
    S = np.cumsum(np.bincount(inverse, weights=np.append(w[rest > 0], 0.0)))
    cf = c.astype(np.float64)
    g = cf * S
    costs, parents = [g[-1]], []
    for _ in range(2, graphs + 1):
        g, par = _extend(g, S, cf)
        costs.append(g[-1])
        parents.append(par)
    sets = []
    for k in range(1, graphs + 1):
        best = int(np.argmin(costs[:k]))  # fewest buckets among equal costs
        j, chosen = len(c) - 1, [int(c[-1])]
        for par in reversed(parents[:best]):
            j = int(par[j])
            chosen.append(int(c[j]))
        sets.append(tuple(sorted(chosen)))
    return sets


def _extend(g: np.ndarray, S: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One DP layer: g'[j] = min_{i<j} g[i] - c_j S_i + c_j S_j, in slabs of columns."""
    m = len(c)
    new, par = np.full(m, np.inf), np.zeros(m, dtype=np.int64)
    width = max(1, _BLOCK_ELEMENTS // m)
    for lo in range(1, m, width):
        hi = min(m, lo + width)
        slab = g[:hi, None] - S[:hi, None] * c[None, lo:hi]
        slab[np.arange(hi)[:, None] >= np.arange(lo, hi)[None, :]] = np.inf
        par[lo:hi] = slab.argmin(axis=0)
        new[lo:hi] = slab[par[lo:hi], np.arange(hi - lo)] + c[lo:hi] * S[lo:hi]
    return new, par


def plan(trace: Trace, opts: PlanOptions, cost: CompileCost | None = None) -> BucketPlan:
    """The chosen sets, with their baselines, Pareto table, budget and holdout."""
    if opts.max_compile_seconds is not None and cost is None:
        raise PlanError("--max-compile-seconds needs a compile-time model: pass --manifest DIR")
    fit, held = trace.split(opts.holdout_split) if opts.holdout_split else (trace, None)
    baseline = powers_of_two_baseline(fit.prompt_lens.max())
    sets = optimal_sets(fit.prompt_lens, opts.graphs, opts.align, opts.max_num_batched_tokens)
    decode, context = _plan_decode(fit, opts), plan_contexts(fit, opts)
    num_seqs = decode.buckets if decode else ()
    contexts = context.buckets if context else None  # None: the manifest's own
    # the grid compiles every num_seqs bucket at every context bucket
    decode_seconds = sum(g.seconds for g in cost.graphs((), num_seqs, contexts)) if cost else None
    distinct = [s for i, s in enumerate(sets) if i == 0 or s != sets[i - 1]]  # k with a gain
    pareto = tuple(_pareto_row(fit, s, cost, contexts, decode_seconds) for s in distinct)
    chosen = _within_budget(pareto, opts.max_compile_seconds)
    holdout = None if held is None else _holdout(held, opts, chosen.buckets, baseline, decode)
    return BucketPlan(chosen, padding_stats(fit.prompt_lens, baseline), opts.align, pareto, decode, context,
                      holdout)


def plan_replayed(
    tokens: np.ndarray, graphs: int, align: int, budget: int, current: Sequence[int], offline: Sequence[int]
) -> dict:
    """``num_batched_tokens_buckets`` minimising the padded tokens of a runtime replay's packed
    calls (``tokens``: each call's prefill-chunk tokens), at most ``graphs`` of them, the largest
    fixed at the token budget. Exact, not an estimate: the scheduler and the packing into calls
    see only the largest token bucket and the row bound (a bucket of ``seq`` tokens holds
    ``min(max_num_seqs, seq)`` rows, never fewer than a call of that many tokens has), and decode
    rows ride in a call only where its bucket has room for them, so the smaller buckets change
    which bucket each call pads to, and which rows ride, and nothing else; each call is then one
    item of the programme above, and its real tokens here are its chunks' (riders left out).
    ``current`` (the config's buckets) is the baseline; ``offline`` (the per-request optimum) is
    scored on the same calls when its largest bucket is the budget, since any other largest
    bucket replays another schedule."""
    if budget % align:
        raise PlanError(
            f"the token budget {budget} (buckets.max_num_batched_tokens) is not a multiple of --align {align}"
        )
    if not len(tokens):
        raise PlanError("the replay ran no packed call: there is nothing to plan")
    # a zero-weight call of the budget itself keeps the largest bucket there
    sets = optimal_sets(np.append(tokens, budget), graphs, align, budget, np.append(np.ones(len(tokens)), 0))
    distinct = [s for i, s in enumerate(sets) if i == 0 or s != sets[i - 1]]
    pareto = [ParetoRow(padding_stats(tokens, s)).padding_json() for s in distinct]
    chosen = sets[-1]
    if len(current) <= graphs and _padded(tokens, current) < _padded(tokens, chosen):
        chosen = tuple(current)  # off --align's grid, the config's own set pads less: never advise worse
    out = padding_stats(tokens, chosen).to_json("calls", "tokens") | {
        "max_num_batched_tokens": budget,
        "baseline": padding_stats(tokens, current).to_json("calls", "tokens"),
        "offline_optimum": None,
        "pareto": pareto,
    }
    if offline[-1] == budget:
        out["offline_optimum"] = padding_stats(tokens, offline).to_json("calls", "tokens")
    return out


def _padded(sizes: np.ndarray, buckets: Sequence[int]) -> float:
    return padding_stats(sizes, buckets).padded_total


def _plan_decode(fit: Trace, opts: PlanOptions) -> DecodePlan | None:
    """num_seqs buckets minimising padded rows over the replayed decode steps (None without
    arrivals). The largest is ``max_num_seqs`` (a grid rule), and the batches a server meets
    under light load (``LIGHT_LOAD``) always get their own graph while the graph count leaves
    room: a lone request never pads to the busy hour's batch. ``why_not`` says when it does not."""
    if fit.arrivals is None:
        return None
    conc = replay_decode(fit, opts.tokens_per_s, opts.max_num_seqs)
    if conc.peak == 0:
        return None
    top = opts.max_num_seqs
    baseline = tuple(powers_of_two(1, top))
    k = opts.decode_graphs or len(baseline)
    light = [b for b in LIGHT_LOAD if b < top]
    forced = light[: k - 1]
    weights = conc.steps[1 : conc.peak + 1]
    # a forced size outweighs every other item together, so each optimum holds it exactly
    heavy = float(weights.sum()) * top + 1.0
    sizes = np.concatenate([np.arange(1, conc.peak + 1), forced, [top]])
    w = np.concatenate([weights, np.full(len(forced), heavy), [0.0]])
    buckets = optimal_sets(sizes, k, 1, top, w)[-1]
    why_not = None
    if len(forced) < len(light):
        why_not = (
            f"{k} decode graph(s) leave no graph for batches {light[len(forced):]}: they pad to the "
            "next num_seqs bucket (raise --decode-graphs)"
        )
    return DecodePlan(conc, buckets, baseline, why_not)


def decode_contexts(trace: Trace, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct contexts of the trace's decode rows and how many rows reach each. Request i
    decodes its tokens 2..o at contexts p+1 .. p+o-1 (the first comes from prefill); requests
    longer than ``max_model_len`` are refused by the runtime and left out. A difference array
    counts every context at once, without a row per token."""
    p, o = trace.prompt_lens.astype(np.int64), trace.output_lens.astype(np.int64)
    keep = (o >= 2) & (p + o <= max_model_len)
    first, last = p[keep] + 1, p[keep] + o[keep] - 1
    size = max_model_len + 2
    diff = np.bincount(first, minlength=size) - np.bincount(last + 1, minlength=size)
    counts = np.cumsum(diff)[: max_model_len + 1]
    contexts = np.flatnonzero(counts)
    return contexts, counts[contexts]


def plan_contexts(fit: Trace, opts: PlanOptions) -> ContextPlan | None:
    """``decode_context_length_buckets`` minimising the context positions decode rows attend,
    against the grid's default (powers of two from 256); None when no request decodes."""
    longest = int((fit.prompt_lens + fit.output_lens).max())
    top = opts.max_model_len or -(-longest // opts.align) * opts.align
    if top % opts.align:
        raise PlanError(f"max_model_len {top} is not a multiple of align={opts.align}")
    contexts, rows = decode_contexts(fit, top)
    if not len(contexts):
        return None
    # the largest bucket must be max_model_len itself (a grid rule): a zero-weight item there
    contexts, rows = np.append(contexts, top), np.append(rows, 0)
    baseline = default_contexts(opts.align, top)
    chosen = optimal_sets(contexts, opts.context_graphs or len(baseline), opts.align, top, rows)[-1]
    return ContextPlan(contexts, rows, chosen, tuple(baseline), top)


def _pareto_row(
    fit: Trace,
    buckets: tuple[int, ...],
    cost: CompileCost | None,
    contexts: tuple[int, ...] | None,
    decode_seconds: float | None,
) -> ParetoRow:
    stats = padding_stats(fit.prompt_lens, buckets)
    if cost is None:
        return ParetoRow(stats)
    graphs = cost.graphs(buckets, (), contexts)  # prefill graphs span the largest context
    seconds = sum(g.seconds for g in graphs)
    return ParetoRow(stats, seconds, sum(g.bytes for g in graphs), seconds + (decode_seconds or 0.0))


def _within_budget(pareto: Sequence[ParetoRow], budget: float | None) -> ParetoRow:
    """The least-padding row (fewest graphs on ties) whose estimated compile time, prefill plus
    decode graphs, fits the budget. The budget selects among the per-K optima; it does not
    re-optimise the buckets under the time constraint."""
    if budget is None:
        return pareto[-1]
    priced = [(r.total_compile_seconds, r) for r in pareto if r.total_compile_seconds is not None]
    fits = [r for seconds, r in priced if seconds <= budget]
    if not fits:
        least = min(seconds for seconds, _ in priced)
        raise PlanError(f"no plan fits --max-compile-seconds {budget}: the cheapest needs {least:.1f}s")
    return min(fits, key=lambda r: (r.stats.padded_total, len(r.buckets)))


def _holdout(
    held: Trace, opts: PlanOptions, buckets: tuple[int, ...], baseline: tuple, decode: DecodePlan | None
) -> dict:
    """How the plan fitted on the early requests pads the later ones (and the baseline too)."""
    out: dict = {
        "split": opts.holdout_split,
        "eval_requests": len(held),
        "prefill": padding_stats(held.prompt_lens, buckets).to_json("requests", "tokens"),
        "baseline": padding_stats(held.prompt_lens, baseline).to_json("requests", "tokens"),
        "decode": None,
    }
    conc = replay_decode(held, opts.tokens_per_s, opts.max_num_seqs)
    if decode is not None and conc.peak:
        out["decode"] = decode_json(conc, decode.buckets, decode.baseline)
    return out
