"""``neuron_buckets.kernels`` in a source checkout: the kernels live in the top-level ``kernels/``.

A built package takes them from there (pyproject's ``package-dir``) and holds them in this place
instead of this file; a checkout run from its root (``PYTHONPATH``) finds them through ``__path__``.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "kernels")]
