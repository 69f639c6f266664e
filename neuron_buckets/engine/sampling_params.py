"""How one request picks its tokens and when it stops: vLLM's ``SamplingParams``, the fields nb runs.

Frozen and checked on construction, so a server can build one from a client's JSON and get one
clear line for any value out of range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neuron_buckets.engine.structured_outputs_params import StructuredOutputsParams
from neuron_buckets.utils.ascii_int import is_int

INT64_MAX = 2**63 - 1
# Below this a temperature is greedy, as in vLLM: dividing float32 logits by a value that small
# overflows to inf, or underflows to a 0 divisor (NaN), and the "sample" is then a wrong token.
MIN_TEMPERATURE = 1e-5
# Each token's new text is searched for every stop string, from as far back as the longest one
# could begin: a cost per token that grows with the stop strings (never with the text), bounded
# here so that one request's stop list cannot slow the requests that share its steps.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
# Most top logprobs a token reports: OpenAI's chat bound, and vLLM's default ``max_logprobs``.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # below MIN_TEMPERATURE (0 included) = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # same seed -> same tokens whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text
    ignore_eos: bool = False
    speculative: bool = True  # draft tokens for it when the engine speculates; False opts out
    logprobs: int | None = None  # each token's logprob and its top-k's; None: none (vLLM's)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (vLLM's)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar every output token obeys
    # vLLM's: the first min_tokens generated tokens never end the request (its end-of-sequence and
    # stop ids are masked there, stop strings not searched); max_tokens and a grammar's end still do
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # a client's JSON gives lists; keep the dataclass hashable and immutable
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        checks = (
            ("temperature", self.temperature, lambda v: v >= 0, "at least 0"),
            ("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "above 0"),
        )
        for name, value, ok, rule in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if not ok(value):
                raise ValueError(f"{name} must be {rule}, got {value!r}")
        # Integers go into int64 tensors and torch's 64-bit seed: a larger one would overflow
        # inside a step, where it would fail every request of the batch instead of this one.
        if not is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be an integer in [0, 2**63) (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if bad := [t for t in self.stop_token_ids if not is_int(t) or not 0 <= t <= INT64_MAX]:
            raise ValueError(f"stop_token_ids must be integers in [0, 2**63), got {bad[:5]}")
        if bad := [s for s in self.stop if not isinstance(s, str) or not s]:
            raise ValueError(f"stop strings must be non-empty strings, got {bad[:5]}")
        if len(self.stop) > MAX_STOP_STRINGS or sum(map(len, self.stop)) > MAX_STOP_CHARS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters "
                             f"in all, got {len(self.stop)} with {sum(map(len, self.stop))} characters")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(self, name)) is not None and not (is_int(k) and 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {k!r}")
        if not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or None, "
                             f"got {type(self.structured_outputs).__name__}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
