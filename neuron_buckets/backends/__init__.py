"""Backend registry: names in configs and on the command line map to implementations here.

Imports are lazy so that choosing one backend never imports another's heavy (or absent) SDK.
"""

from __future__ import annotations

from importlib import import_module

from neuron_buckets.backends.base import Backend, BackendUnavailable, GraphFn

_BACKENDS = {
    "inductor": ("neuron_buckets.backends.inductor", "InductorBackend"),
    "eager": ("neuron_buckets.backends.eager", "EagerBackend"),
    "neuron": ("neuron_buckets.backends.neuron", "NeuronBackend"),
    "xla": ("neuron_buckets.backends.xla", "XlaBackend"),
    "stablehlo": ("neuron_buckets.backends.stablehlo", "StableHloBackend"),
}
BACKEND_NAMES = tuple(_BACKENDS)

__all__ = ["BACKEND_NAMES", "Backend", "BackendUnavailable", "GraphFn", "get_backend"]


def get_backend(name: str) -> Backend:
    """Instantiate a backend by name; unknown names list the known ones."""
    try:
        module, cls = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose one of {list(_BACKENDS)}") from None
    return getattr(import_module(module), cls)()
