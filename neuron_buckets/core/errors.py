"""The one marker the command line needs to tell a user's mistake from a bug in nb."""

from __future__ import annotations


class UserError(Exception):
    """A failure of the user's input or machine, not of nb: ``nb`` shows it as one line, exit 2.

    ``ValueError`` (bad config, checkpoint, manifest, trace, request) and ``OSError`` (disk,
    permissions) count as such too; error classes that are neither inherit this.
    """
