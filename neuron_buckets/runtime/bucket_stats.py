"""Use and waste per bucket, counted alike by the runtime and by ``nb inspect``'s replay."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BucketStats:
    """What vLLM-neuron exports as ``prefill_s{N}`` / ``decode_b{N}``: use and waste per bucket.

    ``padded_tokens`` is every position computed (real and pad), so the waste is
    ``(padded - real) / real``.
    """

    calls: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0

    def add(self, real: int, padded: int) -> None:
        """Count one call of ``padded`` positions, ``real`` of them real tokens."""
        self.calls += 1
        self.real_tokens += real
        self.padded_tokens += padded

    @property
    def padding_ratio(self) -> float:
        return (self.padded_tokens - self.real_tokens) / max(self.real_tokens, 1)
