"""The ``nb`` command line."""

from neuron_buckets.cli.main import app

__all__ = ["app"]
