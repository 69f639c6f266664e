"""``CppLibrary``: one C++ source of nb's CPU kernels, built once per machine, and loaded.

Each kernel's module (``block_kv_cpu``, ``int8_linear_cpu``) declares its op (schema and shape
function) in Python, so any process can trace graphs that call it, and keeps its CPU kernel in a
C++ file beside it. That file is built with ``torch.utils.cpp_extension`` into torch's extension
directory (``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``; the name hashes the
source, torch and the CPU's feature flags), vectorised for the instruction set inductor picks on
this machine plus the library's own ``flags``. ``nb compile`` copies the library into the artifact
(``kernels/<name>.so``, in the manifest with its sha256, as the graphs are), so a serving host
needs no compiler: the runtime registers the artifact's copy before any graph loads, and
AOTInductor calls the op through the package's proxy executor, by name.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags (Linux), or nothing where /proc/cpuinfo does not list them; read once."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def cpu_has(*names: str) -> bool:
    """Whether the CPU lists every one of ``names`` (/proc/cpuinfo's spelling) among its flags."""
    flags = set(cpu_flags().split())
    return all(name in flags for name in names)


@dataclass(frozen=True)
class CppLibrary:
    """The op ``op`` (``nb::name``) whose CPU kernel is the C++ file ``source``."""

    source: Path
    op: str
    what: str  # for errors: "nb's CPU attention kernel"
    flags: tuple[str, ...] = ()  # compiler flags beyond the vector ISA's
    dispatch_key: str = "CPU"  # where the op's kernel is registered
    needs: tuple[str, ...] = ()  # the CPU flags it runs on (/proc/cpuinfo's names), beyond any x86-64's
    needs_name: str = ""  # those, as an error names them: "AVX512-BF16"

    @property
    def name(self) -> str:
        """The library's name in an artifact's manifest: its source's stem."""
        return self.source.stem

    @property
    def file_name(self) -> str:
        """The library's file name in an artifact directory's ``kernels/``."""
        return f"{self.name}.so"

    def registered(self) -> bool:
        """Whether this process has the op's CPU kernel (from a build, or an artifact's library)."""
        return torch._C._dispatch_has_kernel_for_dispatch_key(self.op, self.dispatch_key)

    def build(self) -> Path:
        """The shared library's path, built first if this machine has no build of this source for
        this torch and CPU. A built one is found by name alone: ``nb compile`` calls this every
        run, and probing the vector ISA costs seconds."""
        return _build(self)

    def runs_here(self) -> bool:
        """Whether this CPU has every instruction set the kernel was built for (``needs``)."""
        return cpu_has(*self.needs)

    def register(self, library: Path) -> None:
        """Load an artifact's copy of the built kernel, unless this process already has the op's
        kernel (a second registration of the same op is an error); refused in one line on a CPU
        that cannot run it, which would otherwise die of an illegal instruction mid-step."""
        if not self.runs_here():
            raise RuntimeError(f"this artifact's graphs call {self.what}, which needs {self.needs_name}, and "
                               "this CPU lacks it; compile the artifact on this machine")
        if not self.registered():
            torch.ops.load_library(str(library))

    def ensure(self) -> None:
        """The op's kernel in this process, built if need be: for eager calls outside an artifact
        (tests, references); a trace needs only the op's shape function."""
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or self.registered()):
            self.register(self.build())


@functools.cache
def _build(lib: CppLibrary) -> Path:
    from torch.utils import cpp_extension

    stem = lib.source.stem
    salt = f"{torch.__version__} {cpu_flags()} {lib.flags}"
    digest = hashlib.sha256(lib.source.read_bytes() + salt.encode())
    name = f"nb_{stem}_{digest.hexdigest()[:12]}"
    directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    library = directory / f"{name}.so"
    if library.is_file():
        return library
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()  # what inductor vectorises its own CPU kernels for, on this machine
    # -fopenmp: at::parallel_for is inlined here, and without it runs on one thread
    flags = ["-O3", "-fopenmp", *(f"-D{m}" for m in isa.build_macro()), *isa.build_arch_flags().split(),
             *lib.flags]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(lib.source)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False)
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"cannot build {lib.what} {lib.source.name} (needs a C++ compiler and torch's "
                           f"headers): {first}") from e
    return library
