"""The floor of every greedy equality check: how many steps it compared, asserted and recorded.

A check that stops at the first near-tie (the reference's top two logits within twice the
tolerance, where either token is right and the paths may part) passes vacuously when every step
is a near-tie; one that compares token lists passes vacuously when they are empty. Each check here
asserts how many steps it compared, says so in its message, and records it: a line on stdout
(``pytest -rA -s``) and a ``steps_compared`` property of the test (``--junitxml``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

FLOOR = 0.9  # the share of a check's steps that must be decided (compared), at least

_record: ContextVar[Callable[[str, object], None] | None] = ContextVar("record", default=None)


@contextmanager
def recording(record_property: Callable[[str, object], None]) -> Iterator[None]:
    """Send the counts of the checks run inside to the current test's ``record_property``."""
    token = _record.set(record_property)
    try:
        yield
    finally:
        _record.reset(token)


def assert_floor(compared: int, total: int, floor: float = FLOOR, what: str = "steps") -> int:
    """``compared`` of ``total`` steps is at least ``floor`` of them and more than none; records
    the count and returns it."""
    line = f"compared {compared}/{total} {what}"
    print(line)
    if (record := _record.get()) is not None:
        record("steps_compared", line)
    assert total > 0 and compared > 0 and compared >= floor * total, f"{line}: fewer than {floor:.0%}"
    return compared


def assert_same_tokens(got: Sequence[Sequence[int]], *wants: Sequence[Sequence[int]], total: int) -> int:
    """Exact equality of greedy runs, every request's tokens, over ``total`` tokens in all (what
    the requests were asked for): two empty runs are not equal runs."""
    for want in wants:
        assert [list(t) for t in got] == [list(t) for t in want]
    return assert_floor(sum(len(t) for t in got), total, 1.0, "tokens")


def decided_prefix(logits: torch.Tensor, atol: float) -> tuple[torch.Tensor, int]:
    """The steps of one prompt's reference ``logits`` (steps, vocab) that are no near-tie, and how
    many come before the first one (the steps two greedy paths must share)."""
    top = logits.topk(2, dim=-1).values
    decisive = top[..., 0] - top[..., 1] > 2 * atol
    return decisive, int(decisive.cumprod(0).sum())


def assert_follows(
    want: Sequence[Sequence[int]],
    logits: Sequence[torch.Tensor],
    atol: float | Sequence[float],
    *runs: Sequence[Sequence[int]],
    along: Sequence[torch.Tensor] | None = None,
    floor: float = FLOOR,
) -> int:
    """Each of ``runs`` equals the reference's greedy tokens ``want`` up to each prompt's first
    near-tie of the reference ``logits`` ((steps, vocab) per prompt; ``atol`` per prompt or for
    all); ``along`` (the checked model's logits with ``want`` fed back) lies within ``atol`` of
    them and picks the reference's token at every step that is no near-tie. At least ``floor`` of
    the steps come before the first near-tie; returns how many."""
    atols = [atol] * len(want) if isinstance(atol, float | int) else list(atol)
    compared = total = 0
    for i, (w, ref, a) in enumerate(zip(want, logits, atols, strict=True)):
        decisive, n = decided_prefix(ref, a)
        if along is not None:
            torch.testing.assert_close(along[i], ref, rtol=0, atol=a)
            assert torch.equal(along[i].argmax(-1)[decisive], ref.argmax(-1)[decisive]), i
        for run in runs:
            assert list(run[i][:n]) == list(w[:n]), (i, n)
        compared, total = compared + n, total + len(w)
    return assert_floor(compared, total, floor)
