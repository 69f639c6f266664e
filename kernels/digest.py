"""A digest of the kernel sources, so that editing a kernel invalidates every cached graph.

The compiled graphs embed the kernels (the goldens on CPU backends, the NKI kernels on Neuron), so
the cache key must change whenever any of them changes, even when the model code does not.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent


def kernel_source_digest(root: Path = KERNELS_DIR) -> str:
    """sha256 over every ``*.py`` under ``root``: relative path and bytes, in sorted path order.

    Paths are hashed with the bytes so that renaming or moving a kernel also changes the digest.
    """
    sha = hashlib.sha256()
    sources = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    if not sources:
        raise FileNotFoundError(f"no kernel sources (*.py) under {root}")
    for path in sources:
        sha.update(path.relative_to(root).as_posix().encode())
        sha.update(b"\0")
        sha.update(path.read_bytes())
        sha.update(b"\0")
    return sha.hexdigest()
