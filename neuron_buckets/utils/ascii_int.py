"""Strict integers: values that are integers and nothing else, and integers as written in options
and trace files (ASCII digits with an optional sign).

``bool`` is an ``int`` to Python, so ``isinstance`` alone lets ``true`` count as 1. ``int()`` alone
is too lenient for input that must never be reinterpreted: it takes full-width digits ("１２"),
underscores ("1_000") and surrounding Unicode spaces.
"""

from __future__ import annotations

import re
from numbers import Integral

ASCII_INT = re.compile(r"[ \t]*[+-]?[0-9]+[ \t]*")
BEYOND_INT64 = 2**63  # one past int64's largest magnitude


def is_int(value: object) -> bool:
    """An integer of any integral type (numpy's too), never a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def parse_ascii_int(text: str) -> int | None:
    """The integer ``text`` spells in ASCII (spaces and tabs around it allowed), else None.

    Values beyond int64 come back as ±BEYOND_INT64: every caller refuses them anyway, and int()
    will not even convert a field of thousands of digits.
    """
    if not ASCII_INT.fullmatch(text):
        return None
    sign = -1 if "-" in text else 1
    digits = text.strip(" \t+-").lstrip("0") or "0"
    return sign * (min(int(digits), BEYOND_INT64) if len(digits) <= 19 else BEYOND_INT64)


def in_int64(value: int) -> bool:
    return -BEYOND_INT64 <= value < BEYOND_INT64
