"""One request as the scheduler tracks it: its tokens so far and the blocks that hold their K/V."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    index: int
    tokens: list[int]  # the prompt, then every generated token
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V the cache holds

    @property
    def final_cached(self) -> int:
        """Tokens whose K/V is written by the end: the last generated token is never fed back."""
        return self.prompt_len + self.max_new_tokens - 1

    @property
    def prefilled(self) -> bool:
        return self.cached >= self.prompt_len

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens
