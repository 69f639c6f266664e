"""torch.export + AOTInductor: one ``.pt2`` per bucket, weights kept out and shared at load time.

``package_constants_in_so=False`` leaves the weights out of every package; ``load`` hands each
graph pointers into the single weights copy (``user_managed=True``), so N buckets cost one copy
of the weights. KV caches are graph inputs that the compiled code mutates in place, so every
bucket graph works on the same cache. A graph must never run before its constants are loaded
(it would crash), which is why ``load`` does both in one step.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from neuron_buckets.backends.base import GraphFn

FIXED_CONFIGS = {"aot_inductor.package_constants_in_so": False}


@functools.cache
def _cxx_version() -> str:
    """The C++ compiler that builds the graph's shared library, part of every cache key."""
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    cxx = get_cpp_compiler()
    info = [p for p in get_compiler_version_info(cxx).split("_") if "version" in p]
    return f"{cxx} {info[-1].strip() if info else 'unknown'}"


class InductorBackend:
    name = "inductor"
    graph_ext = "pt2"

    def available(self) -> tuple[bool, str]:
        try:
            _cxx_version()
        except Exception as e:  # no working C++ compiler: AOTInductor cannot build a library
            return False, f"AOTInductor needs a C++ compiler (g++ or clang++): {e}"
        return True, f"torch {torch.__version__}, {_cxx_version()}"

    def versions(self) -> dict[str, str]:
        return {**self.load_versions(), "compiler": _cxx_version()}

    def load_versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        """User inductor configs plus the ones this backend fixes (weights out of the package).

        A misspelt option fails here, once, instead of in every bucket after its export.
        """
        from torch._inductor import config as inductor_config

        if unknown := sorted(set(flags) - set(inductor_config.get_config_copy())):
            raise ValueError(
                f"compile.flags {unknown} are not torch._inductor.config options (torch {torch.__version__})"
            )
        if clash := {k: v for k, v in flags.items() if k in FIXED_CONFIGS and FIXED_CONFIGS[k] != v}:
            raise ValueError(f"compile.flags {clash} conflict with the weights-outside-graph design")
        return {**flags, **FIXED_CONFIGS}

    def compile(
        self, model: nn.Module, example: tuple[Tensor, ...], out_file: Path, flags: dict[str, Any]
    ) -> None:
        with torch.no_grad():
            program = torch.export.export(model, example, strict=False)
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(out_file), inductor_configs=self.resolved_flags(flags)
            )

    def load(
        self, path: Path, weights: dict[str, Tensor], model_config: dict[str, Any], device: str
    ) -> GraphFn:
        index = torch.device(device).index
        compiled = torch._inductor.aoti_load_package(str(path), device_index=-1 if index is None else index)
        wanted = compiled.get_constant_fqns()
        if missing := [k for k in wanted if k not in weights]:
            raise ValueError(f"{path.name}: weights file lacks constants {missing[:5]}")
        compiled.load_constants({k: weights[k] for k in wanted}, check_full_update=True, user_managed=True)
        return compiled
