"""Use and waste per bucket, counted alike by the runtime and by ``nb inspect``'s replay.

One vocabulary everywhere (the CLI, ``--json``, ``/metrics``, the plot): computed tokens are
every position a graph runs, real and padding; the padding share is padding / computed, so 0.91
reads "91% of the compute was padding". ``padded_tokens`` and ``padding_ratio`` (padding / real)
stay as the contract's names for the same counter and its older ratio.
"""

from __future__ import annotations

from dataclasses import dataclass


def padding_share(real: float, computed: float) -> float:
    """Padding over computed positions, between 0 and 1 (0 when nothing was computed)."""
    return (computed - real) / computed if computed else 0.0


@dataclass
class BucketStats:
    """What vLLM-neuron exports as ``prefill_s{N}`` / ``decode_b{N}``: use and waste per bucket.

    ``padded_tokens`` is every position computed (real and pad): the computed tokens.
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
    def computed_tokens(self) -> int:
        return self.padded_tokens

    @property
    def padding_share(self) -> float:
        return padding_share(self.real_tokens, self.padded_tokens)

    @property
    def padding_ratio(self) -> float:
        return (self.padded_tokens - self.real_tokens) / max(self.real_tokens, 1)

    def to_json(self) -> dict:
        """The counters and what they give, as ``--json`` prints them."""
        return {**vars(self), "computed_tokens": self.computed_tokens, "padding_share": self.padding_share}
