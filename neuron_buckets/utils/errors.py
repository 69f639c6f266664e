"""The one marker the command line needs to tell a user's mistake from a bug in nb."""

from __future__ import annotations


class UserError(Exception):
    """A failure of the user's input or machine, not of nb: ``nb`` shows it as one line, exit 2.

    ``ValueError`` (bad config, checkpoint, manifest, trace, request) and ``OSError`` (disk,
    permissions) count as such too; error classes that are neither inherit this.
    """


def brief(value: object, most: int = 40) -> str:
    """A value for a one-line message: its repr, cut short (one trace field can be 128 KiB)."""
    text = repr(value)
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"
