"""Logprobs of the tokens a request emits and of the most likely tokens at each position.

vLLM's default (``logprobs_mode = "raw_logprobs"``): the log-softmax of the model's own logits,
before anything the sampler does to them (repetition penalty, temperature, top-k/p, min-p, a
grammar's mask), so a token's logprob is the model's and does not depend on how it was picked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token (vLLM's)
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, logprob), most likely first


def token_logprobs(logits: Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """One entry per token: ``tokens[j]`` was emitted from ``logits[j]`` (float32 whatever their dtype)."""
    logprobs = logits[: len(tokens)].float().log_softmax(dim=-1)
    ids = torch.as_tensor(tokens, dtype=torch.int64)
    chosen = logprobs.gather(-1, ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1)
    columns = (chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist())
    rows = zip(tokens, *columns, strict=True)
    return [
        TokenLogprob(token, value, rank, tuple(zip(top, values, strict=True)))
        for token, value, rank, top, values in rows
    ]
