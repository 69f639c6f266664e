"""Buckets: the fixed shapes that get a compiled graph, and the one rule that picks among them.

Strategies produce the sorted size lists (powers of two, a linear step, or an explicit list); the
vLLM-neuron rules validate them; ``select_bucket`` picks the smallest that fits at run time, for
the runtime and for ``nb inspect`` alike.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["prefill", "decode"]


@dataclass(frozen=True, order=True)
class Bucket:
    """One compiled shape over ``ctx`` positions of context.

    Decode: ``batch`` block-table rows of ``seq`` (1 + speculation_length) tokens each. Prefill
    (packed): ``seq`` tokens in one run, holding up to ``batch`` segments end to end (prefill
    chunks and decode rows), each over its own block-table row.
    """

    kind: Kind
    batch: int
    seq: int
    ctx: int

    @property
    def tokens(self) -> int:
        """Token positions the graph computes per call (its padded work)."""
        return self.seq if self.kind == "prefill" else self.batch * self.seq

    def samples(self, decode_seq: int) -> int:
        """Logits the head returns per call: every decode token; in a packed call, one per chunk
        or all ``decode_seq`` of a decode row riding in it, for up to ``batch`` segments."""
        return self.batch * self.seq if self.kind == "decode" else min(self.seq, self.batch * decode_seq)

    @property
    def name(self) -> str:
        """The one label of a bucket: vLLM-neuron's ``prefill_s{N}`` / ``decode_b{N}``, plus the
        speculation width and the decode context, which tell buckets of one grid apart."""
        if self.kind == "prefill":
            return f"prefill_s{self.seq}"
        width = f"_s{self.seq}" if self.seq > 1 else ""
        return f"decode_b{self.batch}{width}_c{self.ctx}"


class NoBucketFits(ValueError):
    """A request is larger than every compiled bucket."""


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2*lo, 4*lo, ... and always ``hi`` last, so the largest bucket equals the limit."""
    if lo <= 0 or hi < lo:
        raise ValueError(f"powers of two need 0 < min <= max, got min={lo}, max={hi}")
    sizes = []
    n = lo
    while n < hi:
        sizes.append(n)
        n *= 2
    return [*sizes, hi]


def linear(lo: int, hi: int, step: int) -> list[int]:
    """lo, lo+step, ... and always ``hi`` last."""
    if lo <= 0 or hi < lo or step <= 0:
        raise ValueError(f"linear buckets need 0 < min <= max and step > 0, got {lo}, {hi}, {step}")
    return sorted({*range(lo, hi, step), hi})


def validate_buckets(
    name: str, buckets: Sequence[int], last: int | None = None, last_name: str | None = None
) -> tuple[int, ...]:
    """Apply the vLLM-neuron rules: non-empty, positive, strictly ascending, ending at ``last``
    (the value of the setting ``last_name``, which the error then names)."""
    values = tuple(buckets)
    if not values:
        raise ValueError(f"{name} must not be empty")
    if any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in values):
        raise ValueError(f"{name} must be positive integers, got {list(values)}")
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{name} must be strictly ascending, got {list(values)}")
    if last is not None and values[-1] != last:
        bound = f"{last_name} ({last})" if last_name else str(last)
        raise ValueError(f"{name}'s last entry must equal {bound}, got {list(values)}")
    return values


def select_bucket(buckets: Sequence[int], n: int) -> int:
    """Smallest bucket >= n, by binary search over the ascending list."""
    if n <= 0:
        raise ValueError(f"need a positive size to select a bucket, got {n}")
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        largest = buckets[-1] if buckets else None
        raise NoBucketFits(f"no bucket fits {n}: the largest bucket is {largest}")
    return buckets[i]
