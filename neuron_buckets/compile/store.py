"""The shared compile cache: graphs by key, reused across runs and artifact directories.

Inductor's own caches do not cover AOT packages, so this one does. A graph enters the cache only
by an atomic rename of a finished file, so a killed compile never leaves a valid-looking entry.
Artifact directories get a hard link when possible (no extra disk), else a copy. Because of the
link, editing an artifact's graph in place edits its cache entry too, so every entry carries the
sha256 taken when it was committed and is reused only while its bytes still match.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from neuron_buckets.artifact.manifest import atomic_write, sha256_file

# A worker's graph before ``commit`` (".<key>.<pid>.tmp.<ext>") and a digest being written by
# atomic_write (".<key>.<ext>.sha256.<random>.tmp").
TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.(\d+\.tmp\.\w+|\w+\.sha256\.\w+\.tmp)")
# Other compiles share the cache, so a temp file is stale only once no compile could still be
# writing it: far longer than any one bucket's compile.
STALE_AFTER_S = 24 * 3600


class GraphStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str, ext: str) -> Path:
        return self.root / f"{key}.{ext}"

    @staticmethod
    def digest_path(graph: Path) -> Path:
        return graph.with_name(f"{graph.name}.sha256")

    def get(self, key: str, ext: str) -> Path | None:
        """The cached graph, or None if absent or changed since it was committed."""
        path = self.path(key, ext)
        digest = self.digest_path(path)
        if not (path.is_file() and digest.is_file()):
            return None
        return path if sha256_file(path) == digest.read_text().split()[0] else None

    def compile_seconds(self, key: str, ext: str) -> float:
        """How long the cached graph took to compile (0 for entries that did not record it)."""
        fields = self.digest_path(self.path(key, ext)).read_text().split()
        return float(fields[1]) if len(fields) > 1 else 0.0

    def temp_path(self, key: str, ext: str) -> Path:
        """Where a worker writes before ``commit``; unique per process, ignored by ``get``."""
        return self.root / f".{key}.{os.getpid()}.tmp.{ext}"

    def remove_stale_temps(self, older_than_s: float = STALE_AFTER_S) -> list[Path]:
        """Delete temp files that killed workers left (a graph's size each), by name and age."""
        cutoff = time.time() - older_than_s
        stale = [
            p
            for p in self.root.iterdir()
            if TEMP_NAME.fullmatch(p.name) and p.is_file() and p.lstat().st_mtime < cutoff
        ]
        for p in stale:
            p.unlink(missing_ok=True)
        return stale

    def commit(self, temp: Path, key: str, ext: str, seconds: float = 0.0) -> Path:
        """Publish a finished graph: its sha256 (and compile seconds) first, then the graph, each by
        an atomic rename. A crash in between leaves a digest that matches no graph, which ``get``
        treats as absent. The seconds let artifacts built from the cache report real costs.
        """
        final = self.path(key, ext)
        digest = sha256_file(temp)
        atomic_write(self.digest_path(final), lambda p: p.write_text(f"{digest} {seconds:.3f}"))
        os.replace(temp, final)
        return final

    @staticmethod
    def place(src: Path, dest: Path) -> None:
        """Put a cached graph into an artifact directory atomically: hard link, else copy."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
