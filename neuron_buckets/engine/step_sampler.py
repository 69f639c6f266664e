"""One step's logits in, each segment's tokens out: the sampling stage of the engine's step.

The engine calls ``StepSampler.sample`` once per step with the plan it ran and the logits it
returned; the engine itself never touches logits. Like vLLM's v1 sampler, the stage runs in one
fixed order:

1. prompt logprobs: a chunk that returned every token's logits (its request asked for prompt
   logprobs) scores its prompt tokens; only its last row is sampled;
2. constraints: a grammar's forbidden tokens, then within ``min_tokens`` the stop ids, set to
   -inf on a copy (the raw logits still serve the logprobs); a grammar wins over ``min_tokens``
   (``sampler.mask_early_stops``);
3. tokens: one sampled per single row (``sampler.sample``), or a decode row's drafts verified
   (``rejection_sampler``: the argmax for greedy requests, rejection sampling for the others);
4. logprobs of the emitted tokens, from the raw logits (``logprobs.py``);
5. each grammar advanced over its request's emitted tokens.

Requests meet the grammar here twice more: ``check`` compiles it when a request is validated (on
the server's tokenizer thread), and ``admit`` gives a queued request its matcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from neuron_buckets.core.step_plan import StepPlan
from neuron_buckets.engine.logprobs import token_logprobs
from neuron_buckets.engine.rejection_sampler import accept_greedy, accept_sampled, target_probs
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.request_check import RequestError
from neuron_buckets.engine.sampler import mask_early_stops, sample
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.spec_decode_stats import SpecDecodeStats
from neuron_buckets.engine.structured_output_manager import StructuredOutputManager

NO_IDS = torch.empty(0, dtype=torch.int64)


def early_stops(request: Request, offset: int = 0) -> Tensor:
    """The ids ``request`` may not sample ``offset`` rows after its next token: its stop ids while
    that token is within its ``min_tokens``, else none."""
    return request.early_stops if request.too_early(offset) else NO_IDS


def take_prompt_logprobs(
    plan: StepPlan, requests: Sequence[Request], per_segment: Sequence[Tensor]
) -> list[Tensor]:
    """Each segment's logits to sample from. A prompt chunk of a request that asked for its
    prompt's logprobs returned every token's: those before the prompt's last token are prompt
    logprobs (the logits at i score token i + 1), taken into the request here; the prompt's
    last token's, when the chunk has it, is sampled as any chunk's."""
    rows = list(per_segment)
    for i, (seg, request) in enumerate(zip(plan, requests, strict=True)):
        if not request.wants_prompt_logits:
            continue
        prompt = per_segment[i][: request.prompt_len - 1 - seg.context_len]
        scored = request.token_ids[seg.context_len + 1 : seg.context_len + 1 + len(prompt)]
        request.add_prompt_logprobs(
            seg.context_len, token_logprobs(prompt, scored, request.params.prompt_logprobs or 0)
        )
        rows[i] = per_segment[i][len(prompt) :]
    return rows


class StepSampler:
    def __init__(self, spec_stats: SpecDecodeStats, grammar: StructuredOutputManager | None) -> None:
        """``grammar``: the structured outputs manager, None without a tokenizer (no request may
        then ask for a grammar); ``spec_stats`` counts the drafts verified and accepted."""
        self.spec_stats, self.grammar = spec_stats, grammar

    def check(self, params: SamplingParams, what: str) -> None:
        """A RequestError (one line) for what this stage cannot do for ``params``. A grammar is
        compiled here, once, on the validating thread: ``admit`` then finds it cached."""
        if params.structured_outputs is None:
            return
        if self.grammar is None:
            raise RequestError(f"{what}: structured outputs need a tokenizer, and this engine has none")
        self.grammar.compile(params.structured_outputs)

    def admit(self, request: Request) -> None:
        """Give a request that asks for structured outputs its grammar's matcher."""
        if request.params.structured_outputs is not None and self.grammar is not None:
            request.grammar = self.grammar.matcher(request.params.structured_outputs)

    def sample(self, plan: StepPlan, requests: Sequence[Request], logits: Tensor) -> list[list[int]]:
        """The tokens of each segment that returned logits (``requests[i]`` owns segment i): one
        from a segment's last token's, or for a row with drafts the accepted drafts and the token
        after them; none for the others (a cut prompt's chunk draws nothing from its generator)."""
        per_segment = take_prompt_logprobs(plan, requests, logits.split([s.num_samples for s in plan]))
        sampled: list[list[int]] = [[] for _ in plan]
        if single := [i for i, rows in enumerate(per_segment) if len(rows) == 1]:
            mine = [requests[i] for i in single]
            rows = self.constrain(torch.cat([per_segment[i] for i in single]), [(r, ()) for r in mine])
            params, generators = [r.params for r in mine], [r.generator for r in mine]
            tokens = sample(rows, params, generators, [r.token_ids for r in mine])
            for i, token in zip(single, tokens, strict=True):
                sampled[i] = [token]
        for i in (i for i, rows in enumerate(per_segment) if len(rows) > 1):
            sampled[i] = self.verify(requests[i], per_segment[i], list(plan[i].token_ids[1:]))
        for request, rows, tokens in zip(requests, per_segment, sampled, strict=True):
            if tokens and request.logprobs is not None:
                request.logprobs += token_logprobs(rows, tokens, request.params.logprobs)
            if tokens and request.grammar is not None:
                StructuredOutputManager.accept(request.grammar, tokens)
        return sampled

    def constrain(self, rows: Tensor, segments: Sequence[tuple[Request, Sequence[int]]]) -> Tensor:
        """``rows`` with what each request may not sample at -inf: its grammar's forbidden tokens,
        then its stop ids within ``min_tokens``. ``segments`` covers the rows in order, each
        (request, its drafts) taking ``1 + len(drafts)`` rows. A copy when anything is masked."""
        if self.grammar is not None and any(r.grammar is not None for r, _ in segments):
            rows = rows.to(torch.float32, copy=True)
            self.grammar.mask(rows, [(r.grammar, drafts) for r, drafts in segments])
        stops = [early_stops(r, j) for r, drafts in segments for j in range(1 + len(drafts))]
        return mask_early_stops(rows, stops)

    def verify(self, request: Request, rows: Tensor, draft: list[int]) -> list[int]:
        """A decode row's kept drafts and the token after them, counted in ``spec_stats``."""
        rows = self.constrain(rows, [(request, draft)])
        if request.params.greedy:
            tokens = accept_greedy(rows, draft)
        else:
            tokens = accept_sampled(target_probs(rows, request.params), draft, None, request.generator)
        self.spec_stats.add(len(draft), len(tokens) - 1)
        return tokens
