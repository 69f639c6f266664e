"""Refuse files that users other than their owner can change, the way ssh refuses a loose key.

A compiled graph is native code that runs in the process that loads it, and a manifest decides
what that code is handed. So nb loads an artifact directory, its files and graph store entries
only when neither their group nor other users can write them: otherwise anyone in that group
could put their own code where nb will run it. The refusal names the path and the ``chmod``
that fixes it. The directories above are not checked (as ssh does not check above the home
directory): whoever can rename those can swap the whole directory, so protect them too.
"""

from __future__ import annotations

import stat
from pathlib import Path

from neuron_buckets.utils.errors import UserError


class LoosePermissions(UserError, PermissionError):
    """A file or directory nb would load from that its group or other users can write."""


def check_owner_only(path: Path, what: str) -> None:
    """Raise ``LoosePermissions`` if ``path`` (followed through links) is group- or world-writable.
    A missing path is for the caller to report."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "other users"))
                           if mode & bit)
        raise LoosePermissions(
            f"{what} {path} can be written by {who}, so anyone there could change code nb runs; "
            f"nb loads only files their owner alone can change: chmod go-w {path}"
        )
