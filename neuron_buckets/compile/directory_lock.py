"""One writer per artifact directory: a second ``nb compile`` on it stops with a clear message.

``filelock`` takes an advisory ``flock`` that the kernel releases when its holder dies, so a killed
compile never leaves a stale lock behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from neuron_buckets.utils.errors import UserError

LOCK_FILE = ".nb-lock"
HOLDER_FILE = ".nb-lock.pid"  # beside the lock: filelock truncates the lock file on every try


class DirectoryLocked(UserError, RuntimeError):
    """Another process is writing this artifact directory."""


@contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    directory = Path(directory)
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)  # never group-writable (owner_only.py)
    holder = directory / HOLDER_FILE
    lock = FileLock(directory / LOCK_FILE, blocking=False)
    try:
        lock.acquire()
    except Timeout:
        pid = holder.read_text().strip() if holder.is_file() else "unknown"
        raise DirectoryLocked(
            f"{directory} is being written by another nb compile (pid {pid}); "
            "wait for it to finish or use another --out directory"
        ) from None
    try:
        holder.write_text(str(os.getpid()))
        yield
    finally:
        holder.unlink(missing_ok=True)  # while still held: the next holder writes its own
        lock.release()
