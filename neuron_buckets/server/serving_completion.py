"""``POST /v1/completions`` (vLLM's ``OpenAIServingCompletion``): one prompt, as text or token ids.

``echo`` puts the prompt before each choice's text, once per choice, and with ``logprobs`` its
tokens' logprobs before the choice's; ``max_tokens: 0`` with ``echo`` returns the prompt alone,
leaving out the one token the engine ran.
"""

from __future__ import annotations

from neuron_buckets.engine.logprobs import TokenLogprob
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.server.completion_protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from neuron_buckets.server.openai_protocol import Usage
from neuron_buckets.server.serving import Endpoint, OpenAIServing, new_logprobs
from neuron_buckets.utils.errors import UserError


class CompletionEndpoint(Endpoint[CompletionRequest]):
    id_prefix = "cmpl"

    def __init__(self, body: CompletionRequest, server: OpenAIServing) -> None:
        super().__init__(body, server)
        self.offsets = [0] * body.n  # each streamed choice's text so far: where its next token's starts
        self.echoed = [False] * body.n  # whether choice i has sent the prompt (``echo``) yet

    def prompt_ids(self, tokenizer: Tokenizer | None) -> list[int]:
        body = self.body
        if isinstance(body.prompt, list):
            return body.prompt
        if tokenizer is None:
            raise UserError("this artifact has no tokenizer: send the prompt as a list of token ids")
        return tokenizer.encode(body.prompt, body.add_special_tokens)

    def prompt_text(self, ids: list[int]) -> str:
        """The prompt as ``echo`` repeats it: as sent, or its ids decoded ('' without a tokenizer)."""
        return self.body.prompt if isinstance(self.body.prompt, str) else self.server.decoded(ids)

    def choice(
        self, i: int, text: str, ids: list[int], out: RequestOutput, entries: list[TokenLogprob]
    ) -> CompletionChoice:
        """Choice ``i`` adding ``text`` (tokens ``ids``, scored by ``entries``): the prompt first
        if it is echoed and not sent yet."""
        body = self.body
        if body.echo_only:  # the one token the engine ran is not the client's
            text, ids, entries = "", [], []
        shown_ids: list[int] = ids
        shown: list[TokenLogprob | None] = list(entries)
        if body.echo and not self.echoed[i]:  # the prompt comes first, once per choice
            self.echoed[i] = True
            text = self.prompt_text(out.prompt_token_ids) + text
            shown_ids = [*out.prompt_token_ids, *ids]
            shown = [*(out.prompt_logprobs or []), *entries]
        logprobs = None
        if body.logprobs is not None:
            logprobs = CompletionLogprobs.of(shown_ids, shown, self.server.token_text, self.offsets[i])
            self.offsets[i] += sum(len(t) for t in logprobs.tokens)
        return CompletionChoice(
            index=i, text=text, finish_reason=out.finish_reason, logprobs=logprobs,
            token_ids=ids if body.return_token_ids else None,
        )

    def event(self, index: int, out: RequestOutput) -> Completion | None:
        wanted = self.body.return_token_ids or self.body.logprobs is not None
        if out.new_text or out.finished or (out.new_token_ids and wanted):
            c = self.choice(index, out.new_text, out.new_token_ids, out, new_logprobs(out))
            return Completion(**self.header, choices=[c])
        return None  # a token that adds no text yet (part of a character, a held stop string)

    def usage(self, counted: Usage) -> Usage:
        if not self.body.echo_only:
            return counted
        prompt = counted.prompt_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt)

    def usage_event(self, usage: Usage) -> Completion:
        return Completion(**self.header, choices=[], usage=self.usage(usage))

    def final(self, outs: list[RequestOutput]) -> Completion:
        choices = [self.choice(i, o.text, o.token_ids, o, o.logprobs or []) for i, o in enumerate(outs)]
        return Completion(**self.header, choices=choices, usage=self.usage(Usage.of(outs)))
