"""Host sampling: the filtered distributions are transformers' and the draws follow them.

The chi-square tests draw 20,000 tokens from one fixed logits vector with one seeded generator
and compare the counts with the target distribution written out here from the definitions
(temperature, then top-k, top-p on the renormalised top k, min-p), renormalised. The test
fails when the chi-square p-value is below 0.001 (seeded, so the outcome is fixed), or when any
token outside the kept set is ever drawn.
"""

from __future__ import annotations

import pytest
import torch

from neuron_buckets.engine.rejection_sampler import accept_sampled, target_probs
from neuron_buckets.engine.sampler import (
    CANDIDATES,
    filtered_probs,
    mask_early_stops,
    repetition_penalty,
    sample,
)
from neuron_buckets.engine.sampling_params import MIN_TEMPERATURE, SamplingParams

LOGITS = torch.tensor([3.0, 2.5, 2.2, 1.9, 1.5, 1.2, 0.8, 0.5, 0.1, -0.3, -1.0, -2.0])[torch.randperm(12)]
DRAWS = 20_000
P_VALUE = 1e-3


def target(logits: torch.Tensor, t: float, k: int, p: float, m: float) -> list[float]:
    """The distribution by its definition, one token at a time."""
    probs = (logits.double() / t).softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    order = order[:k] if k else order
    mass = sum(probs[i] for i in order)
    kept, before = [], 0.0
    for i in order:
        if p < 1 and before >= p:
            break
        kept.append(i)
        before += probs[i] / mass
    top = max(probs[i] for i in kept)
    kept = [i for i in kept if probs[i] >= m * top]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize(
    ("t", "k", "p", "m"),
    [(0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.9, 8, 0.9, 0.05)],
    ids=["temperature", "top-k", "top-p", "min-p", "all"],
)
def test_draws_follow_the_renormalised_target(t, k, p, m):
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    gen = torch.Generator().manual_seed(0)
    tokens = sample(LOGITS.expand(DRAWS, -1), [params] * DRAWS, [gen] * DRAWS, [[]] * DRAWS)
    assert_follows(tokens, torch.tensor(target(LOGITS, t, k, p, m), dtype=torch.float64))


def assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    """Chi-square goodness of fit of the drawn tokens to ``probs``; a token of probability 0 is
    never drawn."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    kept = expected > 0
    assert counts[~kept].sum() == 0  # a filtered-out token is never drawn
    stat = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum()
    dof = int(kept.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
    assert p_value > P_VALUE, (stat, dof)


TOP_P = [(0.8, 0, 0.9, 0.0), (0.6, 50, 0.7, 0.02), (0.5, 0, 0.5, 0.0), (1.3, 0, 0.95, 0.01)]


@pytest.mark.parametrize(
    ("scale", "settings", "width"),
    [
        (8.0, TOP_P, CANDIDATES),  # peaked: the largest CANDIDATES hold every top-p set
        (0.5, TOP_P, 3 * CANDIDATES),  # flat: they do not, the whole vocabulary is sorted
        (8.0, [*TOP_P, (1.3, 2000, 0.95, 0.0)], 2000),  # a top-k beyond the candidates
        (0.5, [(1.0, CANDIDATES, 0.9, 0.0), (1.0, 7, 1.0, 0.0)], CANDIDATES),  # top-k alone: no more
        (1.0, [(1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.0)], None),  # no top-k or top-p: nothing sorted
    ],
    ids=["peaked", "flat", "wide-top-k", "top-k", "unsorted"],
)
def test_filtered_probs_equal_transformers_warpers(scale, settings, width):
    """Oracle: transformers' warpers, in generate's order, on rows wider than the candidates."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(settings), 3 * CANDIDATES, generator=gen) * scale
    got, ids = filtered_probs(logits, *(torch.tensor(col) for col in zip(*settings, strict=True)))
    assert (ids if ids is None else ids.shape[1]) == width
    dense = got if ids is None else torch.zeros_like(logits).scatter_(1, ids, got)
    for row, (t, k, p, m) in enumerate(settings):
        warpers = [TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else [])
        warpers += [TopPLogitsWarper(p)] if p < 1 else []
        warpers += [MinPLogitsWarper(m)] if m else []
        scores = logits[row : row + 1]
        for w in warpers:
            scores = w(None, scores)
        torch.testing.assert_close(dense[row : row + 1], scores.softmax(-1), atol=1e-6, rtol=1e-4)


def test_repetition_penalty_equals_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 50, generator=gen)
    histories = [[3, 7, 7, 49], [0, 1]]
    got = repetition_penalty(logits, torch.tensor([1.3, 0.7]), histories)
    for row, (penalty, history) in enumerate(zip([1.3, 0.7], histories, strict=True)):
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits[row : row + 1])
        torch.testing.assert_close(got[row : row + 1], want)


def test_greedy_rows_take_the_argmax_and_draw_nothing():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=gen)
    state = gen.get_state()
    assert sample(logits, [SamplingParams()] * 3, [gen] * 3, [[]] * 3) == logits.argmax(-1).tolist()
    assert torch.equal(gen.get_state(), state)


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 64, generator=gen)
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    others = [SamplingParams(), SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=2.0)]

    def draw(rows: list[int], params: list[SamplingParams]) -> list[int]:
        gens = [torch.Generator().manual_seed(p.seed or i) for i, p in enumerate(params)]
        return sample(logits[rows], params, gens, [[]] * len(rows))

    alone = [draw([0], [mine])[0] for _ in range(3)]
    batched = draw([1, 0, 2, 3], [others[0], mine, others[1], others[2]])[1]
    assert alone == [alone[0]] * 3 and batched == alone[0]


# Values that float32 rounds to 0 (or divides into inf): each must give the argmax, never a NaN row.
UNDERFLOWING = {
    "temperature-1e-45": SamplingParams(temperature=1e-45, seed=1),
    "temperature-1e-38": SamplingParams(temperature=1e-38, seed=1),
    "temperature-floor": SamplingParams(temperature=MIN_TEMPERATURE, seed=1),
    "top-p-1e-50": SamplingParams(temperature=1.0, top_p=1e-50, seed=1),
    "top-p-1e-50-top-k": SamplingParams(temperature=1.0, top_p=1e-50, top_k=5, seed=1),
    "min-p-1": SamplingParams(temperature=1.0, min_p=1.0, seed=1),
    "all-of-them": SamplingParams(temperature=1e-45, top_p=1e-50, min_p=1.0, seed=1),
}


def distinct_logits(rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of 256 distinct integer logits, exact in float16 and bfloat16 too (no ties to break)."""
    gen = torch.Generator().manual_seed(5)
    return torch.stack([torch.randperm(256, generator=gen) - 128 for _ in range(rows)]).to(dtype)


def test_temperatures_below_the_floor_are_greedy():
    assert SamplingParams(temperature=MIN_TEMPERATURE / 2).greedy
    assert SamplingParams(temperature=1e-300).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("params", UNDERFLOWING.values(), ids=UNDERFLOWING.keys())
def test_values_that_underflow_in_float32_give_the_argmax_on_every_sampling_path(dtype, params):
    logits = distinct_logits(3, dtype)
    best = logits.float().argmax(-1).tolist()
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert sample(logits, [params] * 3, gens, [[]] * 3) == best
    mixed = [params, SamplingParams(), SamplingParams(temperature=0.5, top_k=3, seed=2)]
    assert sample(logits, mixed, gens, [[]] * 3)[:2] == best[:2]
    if params.greedy:  # the engine verifies a greedy request's drafts by the argmax, never by probs
        return
    probs = target_probs(logits, params)  # the speculative path's distributions
    assert probs.isfinite().all() and probs.argmax(-1).tolist() == best and (probs.amax(-1) > 0.999).all()
    assert accept_sampled(probs[:2], [best[0]], None, gens[0]) == best[:2]  # the top token, kept
    worst = int(logits[0].float().argmin())
    assert accept_sampled(probs[:2], [worst], None, gens[0]) == [best[0]]  # rejected, then the top one


def test_early_stops_are_masked_except_where_a_grammar_left_nothing_else():
    """Row 0 (unconstrained) loses its stop ids; row 1, a grammar that allows only stop id 3 (it
    is complete), keeps it, since nothing else is left: the grammar wins over min_tokens; row 2
    masks nothing; id 99 is past the vocabulary."""
    inf = float("-inf")
    logits = torch.stack([LOGITS, torch.full((12,), inf).index_fill(0, torch.tensor([3]), 1.0), LOGITS])
    stops = [torch.tensor([3, 5, 99]), torch.tensor([3, 5]), torch.tensor([], dtype=torch.int64)]
    masked = mask_early_stops(logits, stops)
    assert masked[0].isneginf().nonzero().flatten().tolist() == [3, 5]
    assert torch.equal(masked[1:], logits[1:]) and torch.equal(masked[0, :3], LOGITS[:3])
    assert sample(masked, [SamplingParams()] * 3, [None] * 3, [[]] * 3)[1] == 3
