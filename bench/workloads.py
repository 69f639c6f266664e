"""Deterministic generation workloads and the Hugging Face transformers peer that runs them.

A workload is a list of prompts (token-id lists) plus ``max_new_tokens``. Token ids are random in
[10, 49000) so no tokenizer is needed and no special token (ids below 10) appears in a prompt. Every
request generates exactly ``max_new_tokens`` tokens in every engine, so tokens/s are comparable.

Only torch and the standard library are imported at module level; transformers is imported inside
the function that needs it.
"""

from __future__ import annotations

import csv
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TOKEN_LOW = 10
TOKEN_HIGH = 49000
NEW_TOKENS = 32
MAX_PROMPT = 400


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids, and how many tokens each request must generate."""

    name: str
    prompts: list[list[int]]
    max_new_tokens: int

    def to_json(self) -> dict[str, object]:
        """The form ``peer_vllm.py --prompts-json`` reads."""
        return {"name": self.name, "prompts": self.prompts, "max_new_tokens": self.max_new_tokens}


def _random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(TOKEN_LOW, TOKEN_HIGH, (n,), generator=gen).tolist() for n in lengths]


def fixed(seed: int = 0) -> Workload:
    """8 prompts of 50 tokens, 32 new tokens each: a uniform batch with no padding anywhere."""
    return Workload("fixed", _random_prompts([50] * 8, seed), NEW_TOKENS)


def trace_context_tokens(trace_path: Path) -> list[int]:
    """The ``ContextTokens`` column of an Azure LLM inference trace (TIMESTAMP,ContextTokens,...)."""
    with Path(trace_path).open(newline="") as f:
        return [int(row["ContextTokens"]) for row in csv.DictReader(f)]


def mixed(trace_path: Path, n: int = 16, seed: int = 0) -> Workload:
    """``n`` prompts whose lengths are sampled from a real trace, clipped to [1, 400].

    Ragged lengths are what a padded batch pays for and a paged cache does not, so this is the
    workload where the engines differ most.
    """
    population = trace_context_tokens(trace_path)
    rng = random.Random(seed)
    lengths = [min(max(rng.choice(population), 1), MAX_PROMPT) for _ in range(n)]
    return Workload("mixed", _random_prompts(lengths, seed), NEW_TOKENS)


def _load_hf(model_dir: Path, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


def _greedy(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    # min_new_tokens == max_new_tokens masks the eos id at every step and never stops early: the same
    # rule as vLLM's ignore_eos=True with min_tokens == max_tokens, so the two stay comparable.
    eos = model.generation_config.eos_token_id
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos if isinstance(eos, int) else 0,
    )


def transformers_generate_runs(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    attn_implementation: str = "sdpa",
    repeats: int = 1,
    num_threads: int | None = None,
) -> tuple[list[list[int]], list[float]]:
    """Batched greedy generation in transformers eager mode: the new tokens and the seconds of each
    of ``repeats`` timed calls (all of them, for noisy shared machines).

    Eager means plain PyTorch, no ``torch.compile``; attention is transformers' default SDPA
    (``attn_implementation="eager"`` selects its unfused reference attention instead). One
    left-padded batch with an attention mask, float32. A one-prompt warm-up runs first so that
    one-time costs (allocator, kernel selection) are not counted; only the generation is timed,
    not model loading. ``num_threads`` (default: all cores) lets a run match a peer that computes
    on fewer threads.
    """
    torch.set_num_threads(num_threads or os.cpu_count() or 1)
    model = _load_hf(Path(model_dir), attn_implementation)
    with torch.inference_mode():
        ids, mask = _left_pad([prompts[0][:8]], 0)
        _greedy(model, ids, mask, 2)
        ids, mask = _left_pad(prompts, 0)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = _greedy(model, ids, mask, max_new_tokens)
            runs.append(time.perf_counter() - start)
    new = out[:, ids.shape[1] :]
    if new.shape[1] != max_new_tokens:
        raise RuntimeError(f"generated {new.shape[1]} tokens per request, expected {max_new_tokens}")
    return new.tolist(), runs


def transformers_prefill_ms(
    model_dir: Path,
    prompts: list[list[int]],
    repeats: int = 5,
    attn_implementation: str = "sdpa",
    num_threads: int | None = None,
) -> list[float]:
    """Milliseconds of one batched prefill forward (padded batch, KV cache built, last logits only).

    This is the prefill half of ``transformers_generate_runs`` on its own, to split its time into prefill
    and decode.
    """
    torch.set_num_threads(num_threads or os.cpu_count() or 1)
    model = _load_hf(Path(model_dir), attn_implementation)
    ids, mask = _left_pad(prompts, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
            times.append((time.perf_counter() - start) * 1e3)
    return times[1:]
