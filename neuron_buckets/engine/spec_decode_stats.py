"""Speculative decoding's counters: vLLM's ``spec_decode_*`` series, read by ``/metrics`` and
``nb generate --stats``, plus nb's count of the steps the gate (``speculation_gate.py``) kept
drafts out of because they did not pay."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # decode rows that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps_off: int = 0  # steps whose rows might have drafted but speculation was off

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted row emits on average: its accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
