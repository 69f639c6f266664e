"""``neuron_buckets.kernels`` in a source checkout: the block-KV kernels (NKI sources for Neuron and
the torch golden references the model runs) live in the top-level ``kernels/``.

That folder has no ``__init__.py``: run from the checkout's root (``python -m pytest``), it would be
a regular top-level package ``kernels`` ahead of site-packages, hiding Hugging Face's ``kernels``,
which transformers 5.25 requires and imports. Without one it is only a namespace portion, which a
regular package of that name wins over.

A built package takes them from there (pyproject's ``package-dir``) and holds them in this place
instead of this file; a checkout run from its root (``PYTHONPATH``) finds them through ``__path__``.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "kernels")]
