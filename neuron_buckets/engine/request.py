"""One request as the scheduler tracks it: its tokens so far and the blocks that hold their K/V."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)  # a request is itself, not its fields: two may hold equal tokens
class Request:
    index: int
    tokens: list[int]  # the prompt, then every generated token
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V the cache holds
    finish_reason: str | None = None  # "stop", "length" or "abort" once it needs no more steps

    @property
    def final_cached(self) -> int:
        """Tokens whose K/V is written at most: the last generated token is never fed back."""
        return self.prompt_len + self.max_new_tokens - 1

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefilled(self) -> bool:
        return self.cached >= self.prompt_len

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
