"""One request as the engine tracks it: its tokens so far and the blocks that hold their K/V."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    """One request: its tokens so far (prompt then generated) and the blocks holding their K/V."""

    index: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)

    @property
    def final_cached(self) -> int:
        """Tokens whose K/V is written by the end: the last generated token is never fed back."""
        return self.prompt_len + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens
