"""What the engine reports for one request after a step: everything so far and what is new."""

from __future__ import annotations

from dataclasses import dataclass

from neuron_buckets.engine.logprobs import TokenLogprob


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # every token generated so far (a stop token included)
    new_token_ids: list[int]  # the tokens this step added
    text: str  # detokenized generated text so far ('' without a tokenizer); no stop token or string
    new_text: str  # the text this step added (for streaming)
    finished: bool
    finish_reason: str | None  # "stop" (eos, stop token, stop string), "length", "abort"
    stop_reason: int | str | None = None  # the eos or stop token id, or the stop string, that ended it
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when its params asked
    # one per prompt token, None for the first (nothing predicts it), once computed, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # vLLM's: prompt tokens its first admission found in the prefix cache

    def __getattr__(self, name: str) -> object:
        """Only reached for an attribute that does not exist: name the replacement of a 0.1 one."""
        if name == "tokens":
            raise AttributeError("RequestOutput.tokens is now RequestOutput.token_ids (the generated tokens)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
