"""One request, the engine's record of it: its tokens, how it samples and stops, and what of it
was already reported. Its KV state (blocks, cached tokens, block names) is not here: the KV cache
manager keeps it, by request id.

The scheduler reads its tokens and lengths, ``append`` applies its stop rule to each new token,
``output`` says what is new since the last report. ``nb inspect``'s replay makes the same records
from lengths alone (dummy tokens, ``ignore_eos``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from neuron_buckets.engine.detokenizer import Detokenizer
from neuron_buckets.engine.logprobs import TokenLogprob
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.tokenizer import Tokenizer


@dataclass(eq=False)  # a request is itself, not its fields: two may hold equal tokens
class Request:
    request_id: int
    token_ids: list[int]  # the prompt, then every generated token
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None = None  # None for greedy requests, which draw nothing
    detokenizer: Detokenizer | None = None  # None without a tokenizer: no text, no stop strings
    eos_token_ids: Collection[int] = frozenset()
    finish_reason: str | None = None  # "stop", "length" or "abort" once it needs no more steps
    stop_reason: int | str | None = None  # the eos or stop token id, or the stop string
    sent_tokens: int = 0  # generated tokens already reported
    sent_text: int = 0  # characters of text already reported
    logprobs: list[TokenLogprob] | None = None  # one per sampled token if asked (may pass a stop)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token so far, if asked
    grammar: Any = None  # the xgrammar matcher of its structured outputs, None without
    # vLLM's: prompt tokens its first admission found in the prefix cache (-1 until admitted)
    num_cached_tokens: int = -1
    lora: str | None = None  # the LoRA adapter's name, None for the base model
    lora_salt: bytes = b""  # its content digest: its K/V never shares a block with another's
    lora_slot: int = 0  # the slot it runs with while admitted (0: the base model)

    @classmethod
    def create(
        cls,
        request_id: int,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Collection[int] = frozenset(),
        tokenizer: Tokenizer | None = None,
    ) -> Request:
        """A new request with its own generator (seeded, or fresh without a seed) and detokenizer."""
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()  # a fresh nondeterministic seed
            else:
                generator.manual_seed(params.seed)
        detokenizer = Detokenizer(tokenizer, params.stop) if tokenizer else None
        ids = list(prompt_token_ids)
        return cls(
            request_id, ids, len(ids), params, generator, detokenizer, eos_token_ids,
            logprobs=None if params.logprobs is None else [],
            prompt_logprobs=None if params.prompt_logprobs is None else [None],  # the first: none
        )

    def __post_init__(self) -> None:
        # The ids that end it: its stop ids, and its end-of-sequence ids unless it ignores them.
        # Derived here so a request built any way has them: one lookup per token. ``min_tokens``
        # masks the same ids (vLLM's rule), kept as one index tensor when it has a ``min_tokens``.
        eos = frozenset() if self.params.ignore_eos else frozenset(self.eos_token_ids)
        self.stop_ids = frozenset(self.params.stop_token_ids) | eos
        early = sorted(self.stop_ids) if self.params.min_tokens else []
        self.early_stops = torch.tensor(early, dtype=torch.int64)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def speculates(self) -> bool:
        """Whether drafts may be verified for it: not when it opted out, nor with a repetition
        penalty, whose history would change at every draft position."""
        return self.params.speculative and self.params.repetition_penalty == 1

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether its prompt chunks return the logits of every token: it asked for prompt
        logprobs and does not have them all yet. It then computes its whole prompt, never
        sharing cached blocks (a hit would skip positions whose logits it needs)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len

    def add_prompt_logprobs(self, start: int, entries: Sequence[TokenLogprob]) -> None:
        """The logprobs of prompt tokens ``start + 1, ...``, from the logits at ``start, ...``;
        a chunk computed again after a preemption writes the same entries again."""
        assert self.prompt_logprobs is not None
        self.prompt_logprobs[start + 1 : start + 1 + len(entries)] = entries

    def too_early(self, offset: int = 0) -> bool:
        """Whether the token sampled ``offset`` rows after its next one is within ``min_tokens``,
        where it may not stop the request."""
        return self.num_generated + offset < self.params.min_tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def grammar_ended(self) -> bool:
        """Whether its grammar accepted an end-of-sequence token, which only a complete grammar
        allows: nothing after it would be under the grammar."""
        return self.grammar is not None and self.grammar.is_terminated()

    def append(self, token: int) -> None:
        """Add a generated token and apply the stop rule: "stop" at an end-of-sequence or stop
        token (not text) or a stop string (cut from the text), none of them within ``min_tokens``;
        "length" at ``max_tokens``. A grammar wins over that: the end-of-sequence token that ends
        its grammar (accepted before this is called) is "stop", whatever ``min_tokens`` or
        ``ignore_eos`` say, so the output is the grammar's answer and nothing after it."""
        early = self.too_early()
        self.token_ids.append(token)
        if (token in self.eos_token_ids and self.grammar_ended) or (not early and token in self.stop_ids):
            self.stop_reason = token
        elif self.detokenizer is not None:
            self.stop_reason = self.detokenizer.push(token, search=not early)
        if self.stop_reason is not None:
            self.finish_reason = "stop"
        elif self.num_generated >= self.params.max_tokens:
            self.finish_reason = "length"

    def output(self) -> RequestOutput:
        """What the request has that was not reported yet; it counts as reported from now on."""
        finished = self.done
        text = ""
        if self.detokenizer is not None:
            if finished:
                # the text still held is searched unless the last token was within min_tokens
                self.detokenizer.flush(search=not self.too_early(-1))
            text = self.detokenizer.visible(finished)
        generated = self.token_ids[self.prompt_len :]
        out = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.token_ids[: self.prompt_len],
            token_ids=generated,
            new_token_ids=generated[self.sent_tokens :],
            text=text,
            new_text=text[self.sent_text :],
            finished=finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else self.logprobs[: len(generated)],
            prompt_logprobs=None if self.wants_prompt_logits else self.prompt_logprobs,
            num_cached_tokens=max(self.num_cached_tokens, 0),
        )
        self.sent_tokens, self.sent_text = len(generated), len(text)
        return out
