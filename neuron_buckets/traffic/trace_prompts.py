"""Token ids for a trace whose requests name their prompt blocks (Mooncake's ``hash_ids``).

A prefix cache hits on equal tokens, so a replay needs prompts whose contents are equal exactly
where the trace says: each hash id becomes one block of ``trace_block_size`` tokens drawn from a
generator seeded with the id, and whatever a request's ids do not cover gets tokens of its own.
Tokens lie below ``SYNTH_VOCAB``, which any model's vocabulary holds, so the same prompts can be
replayed by ``nb inspect`` and run by the runtime, and both must count the same hits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SYNTH_VOCAB = 256
OWN_SEED = 1 << 62  # above any hash id: seeds of the tokens no hash id covers, one per request


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, SYNTH_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def trace_prompts(
    hash_ids: Sequence[Sequence[int]], prompt_lens: Sequence[int], trace_block_size: int
) -> list[list[int]]:
    """One prompt per request, ``prompt_lens[i]`` tokens: its hash ids' blocks, then its own."""
    blocks: dict[int, list[int]] = {}
    prompts = []
    for i, (ids, n) in enumerate(zip(hash_ids, prompt_lens, strict=True)):
        prompt: list[int] = []
        for h in ids[: -(-n // trace_block_size)]:
            prompt += blocks.setdefault(h, _tokens(h, trace_block_size))
        prompt += _tokens(OWN_SEED + i, max(n - len(prompt), 0))
        prompts.append(prompt[:n])
    return prompts
