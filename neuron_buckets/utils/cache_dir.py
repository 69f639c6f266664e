"""Where nb keeps what it can rebuild: compiled graphs and tool probes, shared by every run."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    base = os.environ.get("NB_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "neuron-buckets"
