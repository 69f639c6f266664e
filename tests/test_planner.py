"""The planner's DP against brute force, the must-show padding wins on the shared traces, the
padding accounting against plain loops, and the decode replay's queueing invariants."""

from __future__ import annotations

import itertools
import time
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_traffic import manifest_of, write_manifest
from test_traces import CODE, CONV

from neuron_buckets.core.bucket import Bucket
from neuron_buckets.traffic import planner
from neuron_buckets.traffic.compile_cost import CompileCost, load_manifest_buckets
from neuron_buckets.traffic.padding_stats import _fifo_starts, padding_stats, replay_decode
from neuron_buckets.traffic.planner import (
    PlanError,
    PlanOptions,
    decode_contexts,
    largest_bucket,
    optimal_sets,
    plan,
    plan_contexts,
    powers_of_two_baseline,
)
from neuron_buckets.traffic.traces import Trace, load_trace


def padded_plain(sizes: list[int], buckets: list[int], weights: list[float] | None = None) -> float:
    """DESIGN.md's rule, one item at a time: full chunks of the largest bucket, then the
    remainder in the smallest bucket that holds it."""
    total = 0
    for i, n in enumerate(sizes):
        cost = 0
        while n > buckets[-1]:
            cost, n = cost + buckets[-1], n - buckets[-1]
        cost += min(b for b in buckets if b >= n)
        total += cost * (1 if weights is None else weights[i])
    return total


def check_against_brute_force(sizes, weights, graphs, align, cap) -> None:
    w = None if weights is None else weights[: len(sizes)]
    top = largest_bucket(max(sizes), align, cap)
    below = range(align, top, align)
    best = min(
        padded_plain(sizes, [*extra, top], w)
        for k in range(graphs)
        for extra in itertools.combinations(below, k)
    )
    sets = optimal_sets(np.array(sizes), graphs, align, cap, None if w is None else np.array(w, float))
    assert len(sets) == graphs
    for k, chosen in enumerate(sets, 1):
        assert len(chosen) <= k and chosen[-1] == top
        assert all(b % align == 0 for b in chosen) and list(chosen) == sorted(set(chosen))
    assert padded_plain(sizes, list(sets[-1]), w) == best
    costs = [padded_plain(sizes, list(s), w) for s in sets]
    assert costs == sorted(costs, reverse=True)  # more graphs never pad more


weights_st = st.none() | st.lists(st.integers(0, 5), min_size=25, max_size=25)


@given(
    sizes=st.lists(st.integers(1, 100), min_size=1, max_size=25),
    weights=weights_st,
    graphs=st.integers(1, 4),
    align=st.sampled_from([4, 8, 16]),
    cap=st.none() | st.integers(16, 120),
)
@settings(max_examples=150, deadline=None)
def test_dp_matches_brute_force(sizes, weights, graphs, align, cap) -> None:
    check_against_brute_force(sizes, weights, graphs, align, cap)


@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=25),
    weights=weights_st,
    graphs=st.integers(1, 3),
    cap=st.none() | st.integers(1, 40),
)
@settings(max_examples=100, deadline=None)
def test_dp_unaligned_in_narrow_slabs_matches_brute_force(sizes, weights, graphs, cap) -> None:
    with mock.patch.object(planner, "_BLOCK_ELEMENTS", 7):  # many column slabs per DP layer
        check_against_brute_force(sizes, weights, graphs, 1, cap)


@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=60),
    buckets=st.lists(st.integers(1, 1000), min_size=1, max_size=6, unique=True),
)
def test_padding_stats_match_a_plain_loop(sizes, buckets) -> None:
    buckets = sorted(buckets)
    stats = padding_stats(np.array(sizes), buckets)
    assert stats.items == len(sizes) and stats.real_total == sum(sizes)
    assert stats.padded_total == padded_plain(sizes, buckets)
    assert stats.chunked == sum(n > buckets[-1] for n in sizes)
    assert stats.padded == tuple(c * b for c, b in zip(stats.calls, buckets, strict=True))


def test_chunking_example() -> None:
    stats = padding_stats(np.array([100, 256, 300, 512, 513]), [128, 256])
    assert stats.calls == (3, 6) and stats.real == (145, 1536)  # 100, 44 and 1 in 128
    assert stats.padded == (384, 1536) and stats.chunked == 3
    doc = stats.to_json("requests", "tokens")
    assert doc["padding_ratio"] == (1920 - 1681) / 1681 and doc["chunked_requests"] == 3
    assert doc["per_bucket"][0] == {
        "seq": 128,
        "calls": 3,
        "real_tokens": 145,
        "computed_tokens": 384,
        "padding_share": 239 / 384,  # padding / computed
        "padded_tokens": 384,
        "padding_ratio": 239 / 145,  # the contract's padding / real
    }
    assert doc["padding_share"] == (1920 - 1681) / 1920 and doc["computed_tokens"] == 1920


def test_powers_of_two_baseline_covers_the_longest_prompt() -> None:
    assert powers_of_two_baseline(5) == (128,)
    assert powers_of_two_baseline(128) == (128,)
    assert powers_of_two_baseline(129) == (128, 256)
    assert powers_of_two_baseline(14050) == tuple(128 << i for i in range(8))


def test_largest_bucket_rules() -> None:
    assert largest_bucket(14050, 64, None) == 14080
    assert largest_bucket(14050, 64, 4100) == 4096  # capped: longer prompts are chunked
    with pytest.raises(PlanError, match="below align=64"):
        largest_bucket(100, 64, 32)
    with pytest.raises(PlanError, match="align must be >= 1"):
        largest_bucket(100, 0, None)


@pytest.mark.parametrize("path", [CODE, CONV], ids=["code", "conv"])
def test_plan_beats_powers_of_two_at_the_same_number_of_graphs(path) -> None:
    trace = load_trace(path)
    baseline = powers_of_two_baseline(trace.prompt_lens.max())
    doc = plan(trace, PlanOptions(graphs=len(baseline), align=64)).to_json()
    prefill = doc["prefill"]
    assert prefill["baseline"]["buckets"] == list(baseline)
    assert len(prefill["buckets"]) <= len(baseline)
    assert prefill["buckets"][-1] >= trace.prompt_lens.max()
    assert prefill["padding_ratio"] <= 0.6 * prefill["baseline"]["padding_ratio"]
    decode = doc["decode"]
    assert decode["padding_ratio"] <= decode["baseline"]["padding_ratio"]
    assert len(decode["buckets"]) <= len(decode["baseline"]["buckets"])


def test_dp_on_the_conversation_trace_is_fast() -> None:
    lengths = load_trace(CONV).prompt_lens
    start = time.perf_counter()
    optimal_sets(lengths, 8, 64)
    assert time.perf_counter() - start < 5.0  # generous; bench/bench_plan.py prints the figure


def test_holdout_fits_on_early_requests_and_reports_the_rest() -> None:
    trace = load_trace(CONV)
    doc = plan(trace, PlanOptions(graphs=8, holdout_split=0.75)).to_json()
    held = doc["holdout"]
    assert doc["prefill"]["requests"] + held["eval_requests"] == len(trace)
    assert doc["prefill"]["requests"] == round(0.75 * len(trace))
    late = trace.split(0.75)[1].prompt_lens.tolist()
    assert held["prefill"]["padded_tokens"] == padded_plain(late, doc["prefill"]["buckets"])
    assert held["prefill"]["padding_ratio"] < held["baseline"]["padding_ratio"]


def _lengths_only(prompts: list[int]) -> Trace:
    return Trace(np.array(prompts), np.ones(len(prompts), np.int64), None, "lengths")


def test_compile_budget_picks_among_the_per_k_optima() -> None:
    trace = _lengths_only([100, 200, 300, 400, 500, 600])
    ten_per_graph = CompileCost({}, (0.0, 10.0), (0.0, 1000.0), contexts=(1024,))
    doc = plan(trace, PlanOptions(graphs=5, align=100, max_compile_seconds=35), ten_per_graph).to_json()
    assert len(doc["prefill"]["buckets"]) == 3 and doc["compile_seconds"] == 30.0
    assert [r["compile_seconds"] for r in doc["pareto"]] == [10.0, 20.0, 30.0, 40.0, 50.0]
    with pytest.raises(PlanError, match="the cheapest needs 10.0s"):
        plan(trace, PlanOptions(graphs=5, max_compile_seconds=5), ten_per_graph)
    with pytest.raises(PlanError, match="needs a compile-time model"):
        plan(trace, PlanOptions(graphs=5, max_compile_seconds=5))


def test_the_compile_budget_prices_a_decode_graph_per_batch_size_and_context(tmp_path) -> None:
    """The grid compiles every num_seqs bucket at every context bucket, so the plan's decode
    compile time is that many graphs, each at its own shape (here every graph costs exactly 2 s
    plus 0.01 s per token, so measured and fitted prices agree)."""
    shapes = [
        Bucket("prefill", 4, 256, 1024), Bucket("prefill", 4, 1024, 1024),
        *(Bucket("decode", b, 1, c) for c in (256, 1024) for b in (1, 2, 4)),
    ]  # fmt: skip
    # (kind, batch, seq, ctx, layer seconds, layer bytes): 0.01 s and 10 bytes a token
    layers = [(b.kind, b.batch, b.seq, b.ctx, 0.01 * b.tokens, 10 * b.tokens) for b in shapes]
    cost = load_manifest_buckets(write_manifest(tmp_path, manifest_of(layers, 1024))).cost
    rng = np.random.default_rng(0)
    trace = Trace(rng.integers(50, 800, 60), np.full(60, 120), np.arange(60) * 0.5, "t")
    doc = plan(trace, PlanOptions(graphs=3, align=16, max_num_seqs=4, max_model_len=1024), cost).to_json()
    num_seqs, contexts = doc["decode"]["buckets"], doc["context"]["buckets"]
    assert len(num_seqs) > 1 and len(contexts) > 1
    decode_seconds = len(contexts) * sum(2 + 0.01 * b for b in num_seqs)
    for row in doc["pareto"]:
        assert row["total_compile_seconds"] - row["compile_seconds"] == pytest.approx(decode_seconds)


def test_compile_cost_uses_measurements_then_a_fitted_line() -> None:
    measured = {Bucket("prefill", 1, 128, 512): (7.0, 900)}
    cost = CompileCost(measured, (0.01, 2.0), (10.0, 0.0), contexts=(256, 512), decode_seq=2)
    assert cost.estimate(Bucket("prefill", 1, 128, 512)).measured
    guess = cost.estimate(Bucket("prefill", 1, 1000, 512))
    assert (guess.seconds, guess.bytes, guess.measured) == (12.0, 10000, False)
    assert not cost.estimate(Bucket("prefill", 1, 128, 1024)).measured  # another context: another graph
    assert cost.shapes([128], [4]) == [  # prefill over the largest context, decode at each
        Bucket("prefill", 1, 128, 512), Bucket("decode", 4, 2, 256), Bucket("decode", 4, 2, 512)
    ]
    assert cost.shapes([], [4], contexts=(1024,)) == [Bucket("decode", 4, 2, 1024)]


def test_decode_replay_small_example() -> None:
    # three requests at t=0 with 10, 20 and 30 tokens at 10 tokens/s through two slots:
    # [0, 1): 2 running, [1, 2): 2 (the third took the first's slot), [2, 4): 1
    trace = Trace(np.array([5, 5, 5]), np.array([10, 20, 30]), np.zeros(3), "t")
    conc = replay_decode(trace, 10.0, 2)
    assert conc.steps.tolist() == [0.0, 20.0, 20.0]
    assert (conc.queued, conc.mean_wait_s, conc.peak) == (1, 1 / 3, 2)
    free = replay_decode(trace, 10.0, 8)
    assert free.steps[1:4].tolist() == [10.0, 10.0, 10.0] and free.queued == 0


@given(
    arrive=st.lists(st.floats(0, 50, allow_nan=False), min_size=1, max_size=40),
    data=st.data(),
    slots=st.integers(1, 6),
)
def test_fifo_replay_invariants(arrive, data, slots) -> None:
    arrive = np.sort(np.array(arrive))
    hold = np.array(data.draw(st.lists(st.floats(0.1, 20), min_size=len(arrive), max_size=len(arrive))))
    start = _fifo_starts(arrive, hold, slots)
    end = start + hold
    assert np.all(start >= arrive) and np.all(np.diff(start) >= 0)  # no early starts, FIFO
    for i in range(len(arrive)):
        running = np.sum((start <= start[i]) & (end > start[i]))
        assert running <= slots
        if start[i] > arrive[i]:  # it waited only because every slot was busy until then
            assert np.sum((start < start[i]) & (end >= start[i])) == slots


def test_replay_decodes_every_output_token() -> None:
    trace = load_trace(CODE)
    for slots in (4, 64):
        conc = replay_decode(trace, 25.0, slots)
        rows = float(np.arange(len(conc.steps)) @ conc.steps)
        assert rows == pytest.approx(trace.output_lens.sum(), rel=1e-9)
        assert conc.peak <= slots


@settings(max_examples=50, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 40)), min_size=1, max_size=12),
    max_model_len=st.integers(2, 100),
)
def test_decode_contexts_count_every_decoded_token(requests, max_model_len) -> None:
    """Against one loop per token: request (p, o) decodes tokens 2..o at contexts p+1..p+o-1,
    and a request longer than max_model_len is left out."""
    prompts, outputs = (np.array(x, dtype=np.int64) for x in zip(*requests, strict=True))
    contexts, rows = decode_contexts(Trace(prompts, outputs, None, "t"), max_model_len)
    want: dict[int, int] = {}
    for p, o in requests:
        if p + o <= max_model_len:
            for ctx in range(p + 1, p + o):
                want[ctx] = want.get(ctx, 0) + 1
    assert dict(zip(contexts.tolist(), rows.tolist(), strict=True)) == want


def test_context_plan_attends_fewer_positions_than_the_default_set() -> None:
    trace = load_trace(CONV)
    doc = plan_contexts(trace, PlanOptions(graphs=1, align=64, max_model_len=4096)).to_json()
    assert doc["buckets"][-1] == 4096 and all(b % 64 == 0 for b in doc["buckets"])
    assert doc["baseline"]["buckets"] == [256, 512, 1024, 2048, 4096]
    assert len(doc["buckets"]) <= len(doc["baseline"]["buckets"])
    assert doc["padding_ratio"] < 0.5 * doc["baseline"]["padding_ratio"]
    contexts, rows = decode_contexts(trace, 4096)
    assert doc["real_positions"] == pytest.approx(float((contexts * rows).sum()))
    with pytest.raises(PlanError, match="not a multiple of align"):
        plan_contexts(trace, PlanOptions(graphs=1, align=64, max_model_len=4000))


@given(
    tokens=st.lists(st.integers(1, 64), min_size=1, max_size=30),
    graphs=st.integers(1, 4),
    align=st.sampled_from([4, 8, 16]),
)
@settings(max_examples=100, deadline=None)
def test_replayed_plan_is_the_least_padding_with_the_budget_kept_largest(tokens, graphs, align) -> None:
    """Every aligned set of at most ``graphs`` buckets ending at the budget pads the replayed
    calls at least as much as the chosen one, which always ends at the budget (the schedule's
    token bound), however small the calls are."""
    budget = 64
    doc = planner.plan_replayed(np.array(tokens), graphs, align, budget, (16, 32, 64), (32, 48))
    below = range(align, budget, align)
    best = min(
        padded_plain(tokens, [*extra, budget])
        for k in range(graphs)
        for extra in itertools.combinations(below, k)
    )
    assert doc["buckets"][-1] == budget and len(doc["buckets"]) <= graphs
    assert doc["padded_tokens"] == best == doc["pareto"][-1]["padded_tokens"]
    assert doc["baseline"]["padded_tokens"] == padded_plain(tokens, [16, 32, 64])
    assert doc["offline_optimum"] is None  # its largest bucket (48) replays another schedule
    with_offline = planner.plan_replayed(np.array(tokens), graphs, align, budget, (64,), (8, 64))
    assert with_offline["offline_optimum"]["padded_tokens"] == padded_plain(tokens, [8, 64])


def test_replayed_plan_refuses_a_budget_off_the_alignment() -> None:
    with pytest.raises(PlanError, match="token budget 100 .* not a multiple of --align 64"):
        planner.plan_replayed(np.array([10, 20]), 2, 64, 100, (100,), (100,))


def test_a_replay_plan_never_advises_worse_than_the_config_it_replays() -> None:
    """Calls of 30 tokens: on --align 64's grid the best is 64, but the config's own 32 (off that
    grid) pads less, so the plan keeps the config's set."""
    tokens = np.full(10, 30)
    doc = planner.plan_replayed(tokens, 3, 64, 128, [32, 64, 128], [64, 128])
    assert doc["buckets"] == [32, 64, 128] and doc["padded_tokens"] == doc["baseline"]["padded_tokens"]
    assert planner.plan_replayed(tokens, 3, 2, 128, [32, 64, 128], [64, 128])["buckets"] == [30, 128]


def test_the_plan_is_typed_records_and_writes_the_json_document_from_them() -> None:
    """``plan`` hands back a ``BucketPlan``; ``--json`` is written from its records, so what the
    records say and what the document says are the same sets."""
    from neuron_buckets.traffic.bucket_plan import BucketPlan, ContextPlan, DecodePlan, ParetoRow

    chosen = plan(load_trace(CONV), PlanOptions(graphs=4, align=64, holdout_split=0.75))
    assert isinstance(chosen, BucketPlan) and isinstance(chosen.chosen, ParetoRow)
    assert isinstance(chosen.decode, DecodePlan) and isinstance(chosen.context, ContextPlan)
    doc = chosen.to_json()
    assert doc["prefill"]["buckets"] == list(chosen.buckets) == doc["pareto"][-1]["buckets"]
    assert doc["decode"]["buckets"] == list(chosen.decode.buckets)
    assert doc["context"]["buckets"] == list(chosen.context.buckets)
    assert [row["graphs"] for row in doc["pareto"]] == [len(row.buckets) for row in chosen.pareto]
    assert doc["holdout"] == chosen.holdout and doc["holdout"]["split"] == 0.75
