"""Which artifact directories ``nb compile`` may write, and which of their files it may remove.

``nb compile`` owns only what it wrote. It writes into a directory that is absent or empty, that
holds a manifest of its own (valid against the schema, toolchain ``neuron-buckets``), or that an
earlier run locked before it was killed (the lock files are nb's). Anything else is refused
before a single byte is written, naming what is in the way. It never writes or deletes through a
symlink: the names it writes must not be links. Pruning removes only graphs, tokenizer files and
kernel libraries that its own previous manifest listed, and temp files matching its own name
patterns: in the artifact directory every such file is stale once we hold the lock (only the lock
holder writes there).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from neuron_buckets.artifact.manifest import (
    GRAPHS,
    KERNELS,
    MANIFEST,
    TOKENIZER,
    WEIGHTS,
    Manifest,
    ManifestError,
    read_manifest,
)
from neuron_buckets.compile.directory_lock import HOLDER_FILE, LOCK_FILE, directory_lock
from neuron_buckets.compile.text_files import TEXT_FILES
from neuron_buckets.config.draft import DRAFT

LOGS = "logs"
OWN_NAMES = (MANIFEST, WEIGHTS, GRAPHS, KERNELS, LOGS, TOKENIZER, DRAFT, LOCK_FILE, HOLDER_FILE)
OWN_FOLDERS = (GRAPHS, KERNELS, LOGS, TOKENIZER, DRAFT)
# Temp files of utils/files.py's writes (".<name>.<mkstemp random>.tmp"; an older run's graphs
# ".<key>.<ext>.<pid>.tmp"), by the directory they are written in.
TEMP_PATTERNS = {
    ".": re.compile(rf"\.({re.escape(MANIFEST)}|{re.escape(WEIGHTS)})\.\w+\.tmp"),
    GRAPHS: re.compile(r"\.[0-9a-f]{64}\.\w+\.\w+\.tmp"),
    LOGS: re.compile(r"\.[\w.-]+\.log\.\w+\.tmp"),
    TOKENIZER: re.compile(rf"\.({'|'.join(map(re.escape, TEXT_FILES))})\.\w+\.tmp"),
    KERNELS: re.compile(r"\.[\w-]+\.so\.\w+\.tmp"),
}
REFUSAL_HINT = (
    "nb compile writes only into an empty directory or one it compiled before; "
    "move it aside or choose another --out"
)


class OutputDirError(ValueError):
    """The ``--out`` directory holds something ``nb compile`` did not write."""


def _listing(names: Iterable[str], most: int = 5) -> str:
    names = sorted(names)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def check_owned(out: Path) -> Manifest | None:
    """The previous manifest if ``out`` is nb's, None if there is none yet; else OutputDirError."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory; {REFUSAL_HINT}")
    for name in OWN_NAMES:
        if (path := out / name).is_symlink():
            raise OutputDirError(
                f"{path} is a symbolic link (to {os.readlink(path)}); nb compile never writes or "
                f"deletes through links; {REFUSAL_HINT}"
            )
    for name in OWN_FOLDERS:
        if (path := out / name).exists() and not path.is_dir():
            raise OutputDirError(f"{path} is not a directory; {REFUSAL_HINT}")
    if (out / MANIFEST).exists():
        try:
            return read_manifest(out)
        except ManifestError as e:
            raise OutputDirError(f"{e}; {REFUSAL_HINT}") from None
    present = {p.name for p in out.iterdir()}
    if not present or present & {LOCK_FILE, HOLDER_FILE}:  # empty, or a first run that was killed
        return None
    raise OutputDirError(f"{out} holds {_listing(present)} and no nb manifest; {REFUSAL_HINT}")


def remove_stale_temps(out: Path) -> list[Path]:
    """Delete the temp files a killed run left (as large as the weights); call under the lock."""
    removed = []
    for sub, pattern in TEMP_PATTERNS.items():
        folder = out / sub
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if pattern.fullmatch(path.name) and path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


@contextmanager
def owned_directory(out: Path) -> Iterator[Manifest | None]:
    """Claim ``out`` for one compile: check ownership (before writing even the lock), lock,
    check again under the lock (another run may have just finished), sweep stale temps, and
    yield the previous manifest (None for a new directory)."""
    check_owned(out)
    with directory_lock(out):
        previous = check_owned(out)
        remove_stale_temps(out)
        yield previous


def prune(out: Path, previous: Manifest | None, keep: set[str]) -> None:
    """Remove the graphs, tokenizer files and kernel libraries the previous manifest listed as
    written and this run no longer lists.

    Only files directly in ``graphs/``, ``tokenizer/`` or ``kernels/`` count, whatever an edited manifest
    claims, and a listed name that is now a symlink loses the link, never its target.
    """
    listed = [rec.file for rec in previous.pieces.values() if rec.status == "ok"] if previous else []
    listed += list(previous.text.files) if previous and previous.text else []
    listed += [lib.file for lib in previous.libraries.values()] if previous else []
    for rel in listed:
        if Path(rel).parent in (Path(GRAPHS), Path(TOKENIZER), Path(KERNELS)) and rel not in keep:
            (out / rel).unlink(missing_ok=True)
