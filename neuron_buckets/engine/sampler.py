"""Host sampling: one token per row of a step's logits, each row with its own parameters and seed.

The head piece returns every row's vocabulary-wide logits and the host picks the tokens (why the
host and not the graph: docs/runtime.md, "Generate, sampling and stop"). The repetition penalty,
temperature, top-k, top-p and min-p are tensor operations over all rows of a kind at once (greedy;
with top-k or top-p, which sort candidates; without, which sort nothing). Only the random draw is
per row: each sampled row takes exactly one uniform number from its own request's generator and
inverts its distribution's CDF with it, so a seeded request draws the same numbers, and therefore
the same tokens, whatever else is in the batch. Greedy rows (temperature below ``MIN_TEMPERATURE``)
take the argmax and draw nothing.

Logits of any dtype are sampled in float32, and no filter may leave a row empty: top-p and min-p
always keep the most likely token (a top_p that rounds to 0 in float32 would otherwise mask
every token, and the draw of an empty row falls on the last id).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from neuron_buckets.engine.sampling_params import SamplingParams


def repetition_penalty(logits: Tensor, penalty: Tensor, histories: Sequence[Sequence[int]]) -> Tensor:
    """transformers' (CTRL) penalty: a token already in the row's history has its logit divided by
    the penalty when positive, multiplied when negative."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    rows = torch.cat([torch.full((len(h),), i) for i, h in enumerate(histories)])
    seen[rows, torch.cat([torch.as_tensor(h, dtype=torch.int64) for h in histories])] = True
    pen = penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)


# Tokens taken, in sorted order, for a top-p row without top-k before falling back to sorting the
# whole vocabulary: when they hold mass p, they hold every token top-p keeps.
CANDIDATES = 1024
KNOBS = ("temperature", "top_k", "top_p", "min_p")


def sorted_candidates(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """The probabilities each row may keep, largest first, with their ids.

    Sorting a 150k vocabulary costs milliseconds per row, so only as much is sorted as a row's
    filters can keep: its top-k, or for top-p alone the ``CANDIDATES`` largest when their mass
    reaches p, else everything. Top-k and top-p are defined on the distribution over the row's
    top-k tokens (all of them without top-k), so the probabilities are normalised over the top k,
    or over the whole vocabulary.
    """
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    full = scaled.logsumexp(dim=-1)
    width = int(k.max())
    values, ids = scaled.topk(min(width, CANDIDATES), dim=-1)  # sorted, descending
    if width > CANDIDATES:
        reached = (values - full[:, None]).exp().sum(dim=-1) >= top_p
        width = int(torch.where((k == vocab) & (top_p < 1) & reached, CANDIDATES, k).max())
        if width > CANDIDATES:
            values, ids = scaled.topk(width, dim=-1)
    values = values.masked_fill(torch.arange(width) >= k[:, None], float("-inf"))
    log_norm = torch.where(k <= width, values.logsumexp(dim=-1), full)
    return (values - log_norm[:, None]).exp(), ids


def filtered_probs(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Each row's distribution after temperature, top-k, top-p and min-p, in transformers' order,
    renormalised: (probabilities, their token ids; None: the whole vocabulary in order).

    top-k keeps exactly k tokens; top-p the fewest leading tokens whose mass reaches p (the
    token that crosses p included, so the first always); min-p the tokens of at least min_p times
    the top probability (so the top one always). Without top-k and top-p nothing is sorted.
    """
    scaled = logits.float() / temperature[:, None]
    masked = bool(((top_k > 0) | (top_p < 1)).any())
    if masked:
        probs, ids = sorted_candidates(scaled, top_k, top_p)
        before = probs.cumsum(dim=-1) - probs
        cut = (before >= top_p[:, None]) & (top_p[:, None] < 1)
        cut[:, 0] = False  # the most likely token, whatever p rounds to
        probs = probs.masked_fill(cut, 0.0)
    else:
        probs, ids = scaled.softmax(dim=-1), None
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        masked = True
    return (probs / probs.sum(dim=-1, keepdim=True) if masked else probs), ids


def mask_early_stops(logits: Tensor, stops: Sequence[Tensor]) -> Tensor:
    """``logits`` with ``stops[i]``'s ids in row i at -inf: what a request within its ``min_tokens``
    may not sample. A copy when anything is masked (the raw logits still serve the logprobs); ids
    past the vocabulary, which no row can sample anyway, are skipped.

    A grammar wins over ``min_tokens``: a row whose grammar mask left only stop ids (a complete
    grammar allows nothing but its end-of-sequence) keeps them, since a row with nothing left
    would draw an arbitrary token outside the grammar; the request then ends there
    (``Request.append``). A model's own logits are finite, so only a grammar empties a row."""
    counts = [len(s) for s in stops]
    if not any(counts):
        return logits
    ids = torch.cat(list(stops))
    rows = torch.repeat_interleave(torch.arange(len(stops)), torch.tensor(counts))
    keep = ids < logits.shape[-1]
    masked = logits.clone()
    masked[rows[keep], ids[keep]] = float("-inf")
    emptied = masked.isneginf().all(dim=-1)
    return torch.where(emptied[:, None], logits, masked) if bool(emptied.any()) else masked


def draw(probs: Tensor, ids: Tensor | None, uniform: Tensor) -> Tensor:
    """Invert each row's CDF at its uniform number; a token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    pos = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(-1), right=True)
    pos = pos.clamp_(max=probs.shape[-1] - 1)
    return (pos if ids is None else ids.gather(-1, pos)).squeeze(-1)


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[Sequence[int]],
) -> list[int]:
    """One token per row of ``logits`` (rows, vocab). ``generators[i]`` serves row i when it
    samples (None for greedy rows); ``histories[i]`` is its prompt and output so far, read only
    when it has a repetition penalty."""
    logits = logits.float()
    if rows := [i for i, p in enumerate(params) if p.repetition_penalty != 1]:
        index, penalty = torch.tensor(rows), torch.tensor([params[i].repetition_penalty for i in rows])
        penalised = repetition_penalty(logits[index], penalty, [histories[i] for i in rows])
        logits = logits.index_copy(0, index, penalised)
    groups: dict[str, list[int]] = {"greedy": [], "top-k/p": [], "full": []}  # one pass each
    for i, p in enumerate(params):
        groups["greedy" if p.greedy else "top-k/p" if p.top_k or p.top_p < 1 else "full"].append(i)
    if len(groups["greedy"]) == len(params):
        return logits.argmax(dim=-1).tolist()
    tokens = torch.empty(len(params), dtype=torch.int64)
    for kind, rows in groups.items():
        if not rows:
            continue
        index = torch.tensor(rows)
        mine = logits if len(rows) == len(params) else logits[index]
        if kind == "greedy":
            tokens[index] = mine.argmax(dim=-1)
            continue
        knobs = (torch.tensor([getattr(params[i], f) for i in rows]) for f in KNOBS)
        probs, ids = filtered_probs(mine, *knobs)
        uniform = torch.cat([torch.rand(1, dtype=torch.float64, generator=generators[i]) for i in rows])
        tokens[index] = draw(probs, ids, uniform)
    return tokens.tolist()
