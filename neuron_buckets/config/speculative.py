"""``[speculative]``: drafting tokens that the target verifies in one decode row (vLLM's names).

Off by default (``num_speculative_tokens = 0``). Drafts ride in the ``1 + speculation_length``
positions a decode row already has, so ``num_speculative_tokens`` may not exceed the artifact's
compiled ``buckets.speculation_length``; the engine checks that when it opens the artifact.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # prompt lookup: no second model
    num_speculative_tokens: int = 0  # 0 = off
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method == "draft_model":
            raise ValueError("speculative.method = 'draft_model' is not built yet; use 'ngram'")
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"speculative.{name} must be a non-negative integer, got {value!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative.prompt_lookup_min and prompt_lookup_max need 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    def check_fits(self, speculation_length: int) -> None:
        """One line when the drafts do not fit the artifact's decode rows."""
        if self.num_speculative_tokens > speculation_length:
            raise ValueError(
                f"speculative.num_speculative_tokens = {self.num_speculative_tokens} exceeds the "
                f"artifact's buckets.speculation_length = {speculation_length}: recompile with "
                f"speculation_length >= {self.num_speculative_tokens} or draft fewer tokens"
            )
