"""The file helpers every stage shares: hash, check, write atomically, copy checked, link else copy.

One place says what "intact" means, for the compiler's reuse, the graph store, the runtime,
``nb verify`` and the tokenizer alike: a regular file, of the recorded size when one is recorded
(a cheap test first), whose sha256 is the recorded one. Every write goes to a temp file beside
its destination (``.<name>.<random>.tmp``, the names ``output_dir.py`` and ``store.py`` sweep)
and is renamed into place, so a reader sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


class DigestMismatch(ValueError):
    """A file whose bytes are not the sha256 they were checked against."""


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def intact(path: Path, sha256: str | None, size: int | None = None, *, links: bool = True) -> bool:
    """Whether ``path`` is a file of ``size`` bytes (when given) whose sha256 is ``sha256``;
    ``links=False`` also refuses a symbolic link (a name nb writes must not point elsewhere)."""
    if not path.is_file() or (not links and path.is_symlink()):
        return False
    if size is not None and path.stat().st_size != size:
        return False
    return sha256_file(path) == sha256


@contextlib.contextmanager
def temp_beside(path: Path) -> Iterator[Path]:
    """A fresh temp name beside ``path`` (nothing is there yet), removed whatever happens."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # never group-writable (owner_only.py)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    tmp.unlink()
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Let ``write`` fill a temp file beside ``path``, fsync it, then rename it into place.

    A failure (a full disk) is an OSError naming ``path``, not the temp file, which is removed.
    """
    try:
        with temp_beside(path) as tmp:
            write(tmp)
            tmp.chmod(0o644)  # whatever the umask: artifacts are meant to be shared
            fsync(tmp)
            os.replace(tmp, path)
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from e


def link_or_copy(src: Path, dest: Path, mode: int | None = None) -> None:
    """Put ``src``'s bytes at ``dest`` atomically: a hard link (no copy on one disk), else a copy;
    ``mode``, when given, is set before the rename (on a link: the shared file's mode)."""
    with temp_beside(dest) as tmp:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, dest)


@contextlib.contextmanager
def checked_copy(path: Path, sha256: str) -> Iterator[Path]:
    """A private copy of ``path`` (in a directory only this user can read), hashed while it was
    written; ``DigestMismatch`` if its bytes are not ``sha256``. Loading the copy closes the gap
    between checking a file and reading it again to load it."""
    with tempfile.TemporaryDirectory(prefix="nb-graph-") as private:
        copy = Path(private) / path.name
        digest = hashlib.sha256()
        with open(path, "rb") as src, open(copy, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != sha256:
            raise DigestMismatch(path)
        yield copy
