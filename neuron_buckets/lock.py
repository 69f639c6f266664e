"""One writer per artifact directory: a second ``nb compile`` on it stops with a clear message.

An advisory ``flock`` is released by the kernel when its holder dies, so a killed compile never
leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".nb-lock"


class DirectoryLocked(RuntimeError):
    """Another process is writing this artifact directory."""


@contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise DirectoryLocked(
                f"{directory} is being written by another nb compile (pid {holder}); "
                "wait for it to finish or use another --out directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
