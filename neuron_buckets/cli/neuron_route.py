"""``nb compile --backend neuron`` on a machine without the Neuron SDK.

Everything up to neuronx-cc runs here: each piece lowered to StableHLO (Neuron's default route
since SDK 2.33) under its content key, with the neuronx-cc command line that would make its NEFF.
So the compile goes on with the stablehlo backend (the same ``[compile] flags``), and then says in
one line that the NEFFs themselves need the SDK. Nothing pretends to be a NEFF.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from neuron_buckets.backends import get_backend
from neuron_buckets.config import Config


def without_sdk(config: Config) -> Config | None:
    """The config compiled with the stablehlo backend instead, where the neuron backend is asked
    for and its SDK is absent; None when nothing changes."""
    if config.compile.backend != "neuron" or get_backend("neuron").available()[0]:
        return None
    return replace(config, compile=replace(config.compile, backend="stablehlo", device="cpu"))


def neff_line(out: Path) -> str:
    """What the stablehlo artifact holds, and what it does not."""
    return (f"NEFFs need the Neuron SDK (neuronx-cc), absent here: {out} holds every piece's StableHLO "
            f"and the neuronx-cc command line that would compile it (nb verify --stablehlo {out} runs "
            f"them on this CPU)")
