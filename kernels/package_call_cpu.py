"""An AOTInductor package called through nb's op, ``nb::package_run``, which releases Python's GIL.

torch's binding of a loaded package's call (``AOTIModelPackageLoader.boxed_run``) holds the GIL for
the whole call. A layer piece is one such call, so while a step runs, no other Python thread of the
process runs: ``nb serve``'s HTTP loop cannot answer ``/metrics`` or ``/health`` nor write a
stream until the piece ends, which on a CPU whose steps are slow is seconds. A torch op releases
the GIL while it runs, so ``package_call_cpu.cpp`` opens the package
in a table of its own and runs it as one. ``nb compile`` carries the library in every CPU artifact
of the inductor backend; one without it (compiled before) is called through torch's binding.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from .cpp_library import CppLibrary

OP = "nb::package_run"
LIBRARY = CppLibrary(Path(__file__).with_suffix(".cpp"), OP, "nb's package call",
                     dispatch_key="CompositeImplicitAutograd")  # no tensor decides its kernel

torch.library.define("nb::package_open", "(str path, int device_index) -> int")
torch.library.define("nb::package_close", "(int handle) -> ()")
torch.library.define("nb::package_call_spec", "(int handle) -> str[]")
torch.library.define(OP, "(int handle, Tensor[] inputs) -> Tensor[]")


def open_package(path: Path, device_index: int) -> tuple[list[str], Callable[[list[Tensor]], list[Tensor]]]:
    """A package's call spec and its call on flat inputs: through nb's op where this process has
    it (``registered``), else through torch's binding. The package stays open while its call lives."""
    if not LIBRARY.registered():
        loader = torch._inductor.aoti_load_package(str(path), device_index=device_index).loader
        return loader.get_call_spec(), loader.boxed_run
    handle = torch.ops.nb.package_open(str(path), device_index)

    def run(flat: list[Tensor]) -> list[Tensor]:
        return torch.ops.nb.package_run(handle, flat)

    weakref.finalize(run, torch.ops.nb.package_close, handle)
    return torch.ops.nb.package_call_spec(handle), run
