"""``neuron_buckets.manifests`` in a source checkout: the schema and default config live in the
top-level ``manifests/``.

A built package takes them from there (pyproject's ``package-dir``) and holds them in this place
instead of this file; a checkout run from its root (``PYTHONPATH``) finds them through ``__path__``.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "manifests")]
