"""Drafts and their verification: prompt lookup proposes what followed the latest earlier match
(with its period past the end), greedy verification gives exactly the tokens of decoding without
drafts, and rejection sampling keeps the target distribution exactly (chi-square, as the sampler
tests do)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from neuron_buckets.engine.ngram_drafter import NgramDrafter
from neuron_buckets.engine.rejection_sampler import accept_greedy, accept_sampled, target_probs
from neuron_buckets.engine.sampling_params import SamplingParams
from tests.test_sampler import LOGITS, assert_follows, target


def test_the_longest_suffix_match_decides_and_the_latest_occurrence_wins():
    drafter = NgramDrafter(min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 6, 7, 2, 9, 6, 7]
    # suffix (6, 7) occurs at 1 and 4; the latest (4) is followed by 2, 9, 6
    assert drafter.propose(tokens, 3) == [2, 9, 6]
    # a 3-gram beats shorter ones: (1, 2, 3) at 0 is followed by 4, although (2, 3) recurs later
    assert NgramDrafter(1, 3).propose([1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3], 1) == [4]


def test_no_match_no_draft_and_drafts_that_reach_the_end_repeat_the_matchs_period():
    assert NgramDrafter(2, 4).propose([1, 2, 3, 4], 3) == []
    assert NgramDrafter(1, 1).propose([1], 3) == []
    assert NgramDrafter(1, 2).propose([4, 8, 4], 5) == [8, 4, 8, 4, 8]  # (4) two back: period 2
    assert NgramDrafter(1, 4).propose([3, 7, 7, 7, 7], 3) == [7, 7, 7]  # a run of one token


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(min_n=3, max_n=2)


TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@given(TOKENS, st.integers(1, 3), st.integers(0, 2), st.integers(1, 5))
def test_a_draft_is_what_followed_an_earlier_occurrence_of_a_suffix(tokens, min_n, extra, k):
    drafter = NgramDrafter(min_n, min_n + extra)
    draft = drafter.propose(tokens, k)
    if not draft:
        # no suffix of min_n..max_n tokens occurs earlier with anything after it
        for n in range(min_n, min(min_n + extra, len(tokens) - 1) + 1):
            suffix = tokens[-n:]
            assert all(tokens[i : i + n] != suffix for i in range(len(tokens) - n))
        return
    assert len(draft) == k
    # what followed the match, going on with the match's period past the end
    n_ok = any(
        tokens[i : i + n] == tokens[-n:] and (tokens[i + n :] * k)[:k] == draft
        for n in range(min_n, min_n + extra + 1)
        for i in range(len(tokens) - n)
    )
    assert n_ok


@given(st.integers(0, 2**31), st.integers(0, 4), st.integers(0, 4))
def test_greedy_verification_gives_the_tokens_of_plain_greedy_decoding(seed, k, agree):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, 16, generator=gen)
    best = logits.argmax(-1).tolist()
    draft = best[: min(agree, k)] + [(t + 1) % 16 for t in best[min(agree, k) : k]]
    out = accept_greedy(logits, draft)
    kept = min(agree, k)
    assert out == best[: kept + 1]


DRAWS = 20_000
PARAMS = SamplingParams(temperature=0.9, top_k=8)


def first_tokens(draft_probs: torch.Tensor | None, draft_token: int | None = None) -> list[int]:
    """The first emitted token of many verified rows whose draft position sees ``LOGITS``: the
    given deterministic draft, or one drawn from ``draft_probs`` each time, as a draft model's is."""
    probs = target_probs(LOGITS.expand(2, -1), PARAMS)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(DRAWS):
        drawn = draft_probs is not None
        token = int(torch.multinomial(draft_probs[0], 1, generator=gen)) if drawn else draft_token
        out.append(accept_sampled(probs, [token], draft_probs, gen)[0])
    return out


def expected() -> torch.Tensor:
    return torch.tensor(target(LOGITS, PARAMS.temperature, PARAMS.top_k, 1.0, 0.0), dtype=torch.float64)


def test_target_probs_are_the_samplers_distribution_over_the_whole_vocabulary():
    probs = target_probs(LOGITS[None], PARAMS)[0].double()
    assert torch.allclose(probs, expected(), atol=1e-6)


@pytest.mark.parametrize("rank", [0, 3, 11], ids=["likely", "unlikely", "filtered-out"])
def test_a_deterministic_draft_keeps_the_target_distribution(rank):
    draft_token = int(LOGITS.argsort(descending=True)[rank])
    assert_follows(first_tokens(None, draft_token), expected())


def test_a_draft_models_distribution_is_corrected_to_the_targets():
    q = torch.softmax(torch.randn(len(LOGITS), generator=torch.Generator().manual_seed(3)) * 2, -1)
    assert_follows(first_tokens(q[None]), expected())


def test_a_fully_accepted_row_draws_its_bonus_token_from_the_last_position():
    logits = torch.stack([torch.full_like(LOGITS, -30).index_fill(0, torch.tensor([4]), 30.0), LOGITS])
    probs = target_probs(logits, PARAMS)
    gen = torch.Generator().manual_seed(1)
    rows = [accept_sampled(probs, [4], None, gen) for _ in range(DRAWS)]
    assert all(len(r) == 2 and r[0] == 4 for r in rows)  # the target is sure of the draft
    assert_follows([r[1] for r in rows], expected())
