"""Fuzzed prefill and decode steps on the inductor runtime: each step either runs, or is refused
with the KV cache bit-identical to before. Inductor graphs do not bounds-check, so a refusal that
came from inside a graph would come after layer 0 had written its K/V."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_buckets.core.step_plan import StepPlan
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from tests.conftest import decode_plan, prefill_plan

pytestmark = pytest.mark.slow  # the session's compiled inductor artifact

VOCAB, NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 256, 64, 8, 128
BAD_IDS = [-1, -5, VOCAB, NUM_BLOCKS, 200, 2**63, 1.5, True, "3"]
MUTATIONS = ["token", "start", "spare", "needed", "null", "duplicate", "drop", None, None, None, None, None]


@st.composite
def steps(draw) -> StepPlan:
    """A plan of prompt chunks or decode rows, mostly plausible (blocks from a shuffled pool), then
    at most one flaw."""
    kind = draw(st.sampled_from(["prefill", "decode"]))
    pool = draw(st.permutations(range(1, NUM_BLOCKS)))
    rows = []
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(1, 1) if kind == "decode" else st.integers(1, 48))
        start = draw(st.integers(0, MAX_LEN - n))
        take = -(-(start + n) // BLOCK_SIZE) + draw(st.integers(0, 2))
        blocks, pool = list(pool[:take]), pool[take:]
        rows.append([draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)), start, blocks])
    flaw = draw(st.sampled_from(MUTATIONS))
    if rows and flaw:
        row = draw(st.sampled_from(rows))
        bad = draw(st.sampled_from(BAD_IDS))
        tokens, _, blocks = row
        if flaw == "token":
            tokens[draw(st.integers(0, len(tokens) - 1))] = bad
        elif flaw == "start":
            row[1] = draw(st.sampled_from([-1, 1.0, MAX_LEN, 2**70]))
        elif flaw == "spare":
            blocks.append(bad)
        elif flaw in ("needed", "null"):
            blocks[0] = bad if flaw == "needed" else 0
        elif flaw == "duplicate":
            blocks[-1] = rows[0][2][0]
        else:
            blocks.pop()
    return (prefill_plan if kind == "prefill" else decode_plan)(rows)


@pytest.fixture(scope="module")
def runtime(compiled_dir: Path) -> BucketRuntime:
    rt = BucketRuntime.open(compiled_dir, preload=True)
    gen = torch.Generator().manual_seed(0)
    rt.k_cache.copy_(torch.randn(rt.k_cache.shape, generator=gen))  # any write shows
    rt.v_cache.copy_(torch.randn(rt.v_cache.shape, generator=gen))
    return rt


def test_every_step_runs_or_leaves_the_cache_bit_identical(runtime):
    outcomes = {"ran": 0, "refused": 0}

    @settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(steps())
    def step_is_atomic(plan: StepPlan) -> None:
        k, v = runtime.k_cache.clone(), runtime.v_cache.clone()
        try:
            runtime.run_plan(plan)
        except ValueError:
            outcomes["refused"] += 1
            assert torch.equal(runtime.k_cache, k) and torch.equal(runtime.v_cache, v)
        else:
            outcomes["ran"] += 1

    step_is_atomic()
    assert sum(outcomes.values()) >= 500
    assert min(outcomes.values()) >= 50, outcomes  # both paths well exercised
