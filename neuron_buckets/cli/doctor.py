"""``nb doctor``: which backends and devices are usable on this machine, and why not.

Every line is (name, usable, detail); the detail of an unusable line says what to install or change.
"""

from __future__ import annotations

import torch

from neuron_buckets.backends import BACKEND_NAMES, get_backend
from neuron_buckets.backends.neuron import neuron_device_present


def _backend_line(name: str) -> tuple[str, bool, str]:
    try:
        usable, detail = get_backend(name).available()
    except Exception as exc:  # a broken install must show up as a line, not end the report
        return name, False, f"checking it failed: {type(exc).__name__}: {exc}"
    return name, usable, detail


def _cuda_line() -> tuple[str, bool, str]:
    if torch.cuda.is_available():
        return "cuda device", True, f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    if torch.version.cuda is None:
        return "cuda device", False, f"torch {torch.__version__} is a CPU-only build"
    return "cuda device", False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


def _neuron_device_line() -> tuple[str, bool, str]:
    if neuron_device_present():
        return "neuron device", True, "/dev/neuron0 present"
    return "neuron device", False, "no /dev/neuron0: needs a Trn/Inf instance with the Neuron driver"


def doctor_report() -> list[tuple[str, bool, str]]:
    """One line per backend (in registry order), then the CUDA and Neuron devices."""
    return [*map(_backend_line, BACKEND_NAMES), _cuda_line(), _neuron_device_line()]
