"""torch.export + AOTInductor: one ``.pt2`` per piece, with weights and caches as inputs.

A piece has no parameters of its own (``model/pieces.py``), so its package holds code only; the
runtime passes each call the weights it needs, from its one copy, and the KV cache slice the
compiled code mutates in place. ``package_constants_in_so=False`` stays fixed so that no user
flag can bake tensors into a package.

Threads: inductor writes the compiling process's thread count into the C++ it generates, and a
compile worker runs with one share of the cores. Every piece is compiled with ``cpp.dynamic_threads``
instead, so its loops run on the serving process's threads (as the GEMMs it calls do): the
in-place paged decode attention is all loops, and single-threaded loops leave the other cores
idle for it (CHANGELOG has the figures). It is also needed for correctness: the CPU flex
attention template sizes per-thread scratch buffers by ``cpp.threads`` and corrupts the heap
when it runs on more threads than that, so ``cpp.threads`` is ``MAX_THREADS`` and a runtime
never uses more. Both are fixed: a user flag cannot change them.

Projections: float32 CPU graphs (and bfloat16 ones, where the CPU has native bfloat16) call
oneDNN over weights the runtime packs once as it loads them (``model/linear.py``; ``pack``
here): a packed weight is read in the layout oneDNN's kernels
want, instead of being reordered on every call as aten's mm over dense weights does, which
pays for prefill calls and decode steps alike (CHANGELOG has the figures).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from neuron_buckets.backends.base import BackendUnavailable, GraphFn
from neuron_buckets.kernels import package_call_cpu
from neuron_buckets.kernels.libraries import LIBRARIES
from neuron_buckets.kernels.linear_choice import linear_choice
from neuron_buckets.model import linear
from neuron_buckets.model.weights import LayerWeights
from neuron_buckets.utils.cache_dir import default_cache_dir

MAX_THREADS = 256
# What CPU projections call, so that a graph from before the weights of its dtype were packed
# (aten's mm over dense weights) is refused with one line instead of failing on a packed weight.
PROJECTIONS = "onednn-packed" if torch.backends.mkldnn.is_available() else "aten"
if linear.available(torch.bfloat16, "cpu"):
    PROJECTIONS += "+bfloat16"
FIXED_CONFIGS = {
    "aot_inductor.package_constants_in_so": False,
    "cpp.dynamic_threads": True,
    "cpp.threads": MAX_THREADS,
}
# The words of an inductor option's name that mark it as naming a program, a path, a library or
# code to load, or a cache of code built elsewhere: from a config file (data) such an option could
# run any program at compile time (``cpp.cxx`` is the C++ compiler inductor calls), so these are
# refused, by their words, so that options later torch releases add are refused too.
CODE_WORDS = frozenset({
    "cxx", "dir", "path", "logpath", "home", "lib", "libs", "library", "shim", "shims", "remote", "upload",
    "custom", "hook", "hooks", "fn", "class", "external",
})
CODE_ENDINGS = ("opt_level", "_output")  # compiler command-line flags; a file to write


def runs_code(option: str) -> bool:
    """Whether an inductor option names a program, path, library or code (``CODE_WORDS``)."""
    return bool(CODE_WORDS.intersection(re.split(r"[._]", option))) or option.endswith(CODE_ENDINGS)


@functools.cache
def _cxx_version() -> str:
    """The C++ compiler that builds the graph's shared library, part of every cache key."""
    return _probe()["cxx"]


def _probe_key() -> str:
    """What the probe's answers depend on: torch, and the compilers inductor may pick (by the
    ``CXX`` variable, else ``g++`` or ``clang++`` on PATH) with their files' modification times."""
    parts = [torch.__version__, os.environ.get("CXX", "")]
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and (path := shutil.which(name)):
            parts.append(f"{path}:{os.stat(path).st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@functools.cache
def _probe() -> dict[str, Any]:
    """The compiler version and inductor's option names. Asking costs an import of
    ``torch._inductor`` (over a second), so the answers are kept under the cache directory,
    keyed by ``_probe_key``: a warm ``nb compile`` that has nothing to build never pays it."""
    path = default_cache_dir() / "probes" / f"inductor-{_probe_key()}.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    cxx = get_cpp_compiler()
    info = [p for p in get_compiler_version_info(cxx).split("_") if "version" in p]
    found = {
        "cxx": f"{cxx} {info[-1].strip() if info else 'unknown'}",
        "options": sorted(inductor_config.get_config_copy()),
    }
    with contextlib.suppress(OSError):  # a read-only cache only costs the next run the probe
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(found))
        os.replace(tmp, path)
    return found


class InductorBackend:
    name = "inductor"
    graph_ext = "pt2"
    dynamic_shapes = True
    fresh_layers = True
    cpu_kernels = True

    def available(self) -> tuple[bool, str]:
        try:
            _cxx_version()
        except Exception as e:  # no working C++ compiler: AOTInductor cannot build a library
            return False, f"AOTInductor needs a C++ compiler (g++ or clang++): {e}"
        return True, f"torch {torch.__version__}, {_cxx_version()}"

    def versions(self) -> dict[str, str]:
        return {**self.load_versions(), "compiler": _cxx_version()}

    def load_versions(self) -> dict[str, str]:
        """What a loaded graph needs of this machine: the same torch, and the vector ISA its C++
        was generated for (inductor follows ATen's CPU capability), so that AVX-512 graphs in a
        cache shared with an AVX2-only machine get other keys there, and a copied artifact is
        refused with one line instead of dying on an illegal instruction. Also the path this CPU's
        W8A8 and bfloat16 projections take (``kernels/linear_choice.py``), which decides the kernel
        a graph calls and the layout the runtime packs its weights in: graphs and weights must
        agree."""
        choice = linear_choice()
        return {
            "torch": torch.__version__,
            "cuda": torch.version.cuda or "none",
            "cpu_isa": torch.backends.cpu.get_cpu_capability(),
            "int8_w8a8": choice.int8_w8a8,
            "bf16": choice.bf16,
            "projections": PROJECTIONS,
        }

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        """User inductor configs plus the ones this backend fixes (weights out of the package).

        A misspelt option fails here, once, instead of in every bucket after its export.
        """
        if code := sorted(filter(runs_code, flags)):
            raise ValueError(f"compile.flags {code} name a program, path, library or code to load, which "
                             "a config file may not: nb refuses them")
        if flags and (unknown := sorted(set(flags) - set(_probe()["options"]))):
            raise ValueError(
                f"compile.flags {unknown} are not torch._inductor.config options (torch {torch.__version__})"
            )
        if clash := {k: v for k, v in flags.items() if k in FIXED_CONFIGS and FIXED_CONFIGS[k] != v}:
            raise ValueError(f"compile.flags {clash} conflict with what the inductor backend fixes: weights "
                             "outside the graph, loops on the serving threads")
        return {**flags, **FIXED_CONFIGS}

    def compile(
        self, piece: nn.Module, example: tuple, out_file: Path, flags: dict[str, Any], dynamic: tuple | None
    ) -> None:
        configs = {**self.resolved_flags(flags), "aot_inductor.custom_ops_to_c_shims": linear.C_SHIMS}
        with torch.no_grad(), linear.onednn():
            program = torch.export.export(piece, example, dynamic_shapes=dynamic, strict=False)
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(out_file), inductor_configs=configs
            )

    def pack(self, layer: LayerWeights) -> LayerWeights:
        return linear.pack(layer)

    def pack_head(self, weight: Tensor) -> Tensor:
        return linear.pack_dense(weight)

    def load(self, path: Path, model_config: dict[str, Any], device: str) -> GraphFn:
        if torch.get_num_threads() > MAX_THREADS:  # the graphs' per-thread buffers stop there
            torch.set_num_threads(MAX_THREADS)
        index = torch.device(device).index
        for library in LIBRARIES.values():
            if not library.registered() and _calls_op(path, library.op):
                raise BackendUnavailable(f"graph {path.name} calls {library.op}, whose kernel library the "
                                         "artifact does not carry; recompile it with nb compile")
        return PackageCall(*package_call_cpu.open_package(path, -1 if index is None else index))


def _calls_op(package: Path, op: str) -> bool:
    """Whether a package calls ``op`` through its proxy executor: AOTInductor lists such calls in
    the package's ``*.wrapper.json``."""
    with zipfile.ZipFile(package) as z:
        return any(op in z.read(name).decode() for name in z.namelist() if name.endswith("wrapper.json"))


class PackageCall:
    """A loaded package's call path without per-call overhead. The stock wrapper re-reads and
    parses the package's call spec (JSON) and walks the inputs with pytree on every call; a
    layer piece is called once per layer per step, so this parses the output spec once and
    flattens the pieces' inputs (tensors, and one tuple of weights) directly. ``run`` is the
    package's call (``kernels/package_call_cpu.py``: without the GIL where it can)."""

    def __init__(self, spec: list[str], run: Callable[[list[Tensor]], list[Tensor]]) -> None:
        self.run = run
        self.out_spec = pytree.treespec_loads(spec[1])

    def __call__(self, *args: Tensor | tuple[Tensor, ...]) -> Any:
        flat = [t for a in args for t in (a if isinstance(a, tuple) else (a,))]
        return pytree.tree_unflatten(self.run(flat), self.out_spec)
