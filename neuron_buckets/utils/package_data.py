"""The files shipped beside the code in ``manifests/`` (the manifest's JSON Schema, the default
config), read wherever the package lives: a built package, or a checkout (``manifests/__init__.py``)."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path


def read_package_data(name: str) -> str:
    return (Path(import_module("neuron_buckets.manifests").__path__[0]) / name).read_text()
