"""Verifying drafts in one target step: which drafted tokens a request keeps, and the token after.

The target's row of ``1 + k`` tokens gives its logits at every draft position. Greedy requests
keep drafts while the target's argmax agrees, then take the argmax where it first disagrees (or
after the last draft), so their tokens are exactly those of decoding without drafts. Sampled
requests use speculative rejection sampling (Leviathan et al., Chen et al.; vLLM's rejection
sampler): draft ``x`` with draft probability ``q(x)`` is kept with probability
``min(1, p(x) / q(x))``; the first rejected position draws from ``max(0, p - q)`` renormalised,
and a fully accepted row draws a bonus token from the target. Each emitted token then follows the
target distribution ``p`` exactly. A prompt-lookup draft is deterministic: ``q`` is one-hot.

Every row draws ``k + 1`` uniform numbers from its own generator, used or not, so a seeded
request's randomness does not depend on how many drafts the others accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from neuron_buckets.engine.sampler import draw, filtered_probs
from neuron_buckets.engine.sampling_params import SamplingParams


def accept_greedy(logits: Tensor, draft: Sequence[int]) -> list[int]:
    """The kept drafts, then the target's own next token. ``logits``: (len(draft) + 1, vocab)."""
    best = logits.argmax(dim=-1)
    agree = (best[: len(draft)] == torch.as_tensor(draft, dtype=torch.int64)).cumprod(dim=0)
    kept = int(agree.sum())
    return [*draft[:kept], int(best[kept])]


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The request's sampling distribution at every position, over the whole vocabulary."""
    n = logits.shape[0]
    knobs = (torch.full((n,), float(getattr(params, f))) for f in ("temperature", "top_p", "min_p"))
    temperature, top_p, min_p = knobs
    top_k = torch.full((n,), params.top_k, dtype=torch.int64)
    probs, ids = filtered_probs(logits.float(), temperature, top_k, top_p, min_p)
    if ids is None:
        return probs
    return torch.zeros_like(logits, dtype=probs.dtype).scatter_(-1, ids, probs)


def accept_sampled(
    probs: Tensor, draft: Sequence[int], draft_probs: Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """Rejection sampling of one row. ``probs``: the target's (k + 1, vocab) distributions;
    ``draft_probs``: the drafter's (k, vocab) distributions, None for a deterministic draft."""
    k = len(draft)
    uniform = torch.rand(k + 1, dtype=torch.float64, generator=generator)
    ids = torch.as_tensor(draft, dtype=torch.int64)
    if draft_probs is None:
        draft_probs = torch.zeros(k, probs.shape[-1], dtype=probs.dtype).scatter_(-1, ids[:, None], 1.0)
    p = probs[:k].gather(-1, ids[:, None]).squeeze(-1).double()
    q = draft_probs.gather(-1, ids[:, None]).squeeze(-1).double()
    accepted = (uniform[:k] * q < p).cumprod(dim=0)  # u < p/q without dividing by q = 0
    kept = int(accepted.sum())
    if kept == k:
        last = probs[k]
    else:
        residual = (probs[kept] - draft_probs[kept]).clamp_(min=0)
        # p == q leaves no residual mass; then p itself is the right distribution to draw from
        last = residual if float(residual.sum()) > 0 else probs[kept]
    token = draw((last / last.sum())[None], None, uniform[k : k + 1])
    return [*draft[:kept], int(token)]
