"""Refusing a request that could never complete, when it is added and before anything runs."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.runtime.step_check import StepLimits, check_token_ids
from neuron_buckets.utils.errors import UserError


class RequestError(UserError, ValueError):
    """A request that could never complete: refused when it is added, before anything runs."""


def checked_ids(prompt: Sequence[int] | Tensor, limits: StepLimits, what: str) -> list[int]:
    """The ids as ints, or a RequestError naming ``what``: empty, or ids outside the vocabulary."""
    try:
        ids = check_token_ids(prompt, limits.vocab_size, what)
    except ValueError as e:
        raise RequestError(str(e)) from None
    if not ids:
        raise RequestError(f"{what} is empty; every prompt needs at least one token")
    return ids


def check_request(
    prompt: Sequence[int] | Tensor, max_tokens: int, limits: StepLimits, pool: BlockPool, what: str
) -> list[int]:
    """The prompt's ids as ints, or a RequestError naming ``what``: empty, ids outside the
    vocabulary, longer than max_model_len with its ``max_tokens``, or a prompt alone of more blocks
    than the pool (its output takes blocks as it is written, preempting others if it must)."""
    ids = checked_ids(prompt, limits, what)
    total = len(ids) + max_tokens
    if total > limits.max_model_len:
        raise RequestError(
            f"{what}: {len(ids)} prompt tokens + max_tokens {max_tokens} = {total} exceeds "
            f"max_model_len {limits.max_model_len}"
        )
    usable = pool.num_blocks - 1  # block 0 is the null block
    if (need := pool.blocks_for(len(ids))) > usable:
        raise RequestError(f"{what} needs {need} blocks of {pool.block_size} tokens, the pool has {usable}")
    return ids
