"""Block-KV attention on the CPU, for every step: a C++ kernel, ``nb::block_kv_attention``.

Decode rows: a decode step reads every cached K and V vector of its rows once, so its attention
is bound by memory. Inductor's loops over ``block_kv_paged`` compute one 64-wide dot product per
score, reduced across the vector register each time, with the query's rotation recomputed inside
it. ``block_kv_cpu.cpp`` walks each row's blocks in order (all kv heads of a slot at once, the next
block prefetched), transposes each block's keys so that a query's scores are broadcast
multiply-adds with no reduction across the register, and keeps an online softmax per query
(faster than the inductor kernel it replaced; CHANGELOG has the figures).

Prompt chunks: their attention is compute, about a tenth of a prefill layer's work. Flex
attention's CPU template ran it far below the GEMM rate (CHANGELOG has the figures). Here each
tile of a segment's queries, the query heads of one kv head stacked, meets chunks of keys in two
GEMMs (scores, then weighted values; ``sgemm_`` of the BLAS torch links, MKL in its x86 wheels)
with an online softmax between; keys past the tile's last token or outside a window are never
computed, and the context is gathered from its blocks, never past its length.

Both keep the golden's contract, masking and NaN safety (``block_kv_torch``), tested against it.

bfloat16 and float16 models take the same kernel: the cache is read in its own dtype (half the
bytes a decode row streams) and widened to float32 block by block, so scores, softmax and sums run
in float32 and only the output is rounded. The torch paths it replaces there (flex attention and
its helpers) are generic CPU templates that a half-precision step with context ran several times
slower than this kernel.

The op is declared here (schema and shape function), so any process can trace and compile graphs
that call it. Its CPU kernel is C++, vectorised with ATen's ``Vectorized`` for the instruction set
inductor picks on this machine (AVX-512, AVX2, or none), and built with
``torch.utils.cpp_extension`` into torch's extension directory (``TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions``; the name hashes the source, torch and the CPU's feature flags).
``nb compile`` builds it and copies the library into the artifact (``kernels/block_kv_cpu.so``, in the
manifest with its sha256, as the graphs are), so a serving host needs no compiler: the runtime
registers the artifact's copy before any graph loads, and AOTInductor calls the op through the
package's proxy executor, by name. An eager call outside an artifact (tests, references) builds it
on first use.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_suffix(".cpp")
OP = "nb::block_kv_attention"
LIBRARY = "block_kv_cpu.so"  # its file name in an artifact directory's kernels/

torch.library.define(
    OP,
    "(Tensor q, Tensor k_active, Tensor v_active, Tensor k_cache, Tensor v_cache, Tensor block_table, "
    "Tensor cache_lens, Tensor segment_ids, float scale, int? window) -> Tensor",
)


@torch.library.register_fake(OP)
def _block_kv_attention_fake(q: Tensor, *_: object) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


DTYPES = ("float32", "bfloat16", "float16")  # what the kernel reads, each computed in float32


def applies(device: torch.device | str, *dtypes: torch.dtype | str) -> bool:
    """Whether attention on ``device`` over tensors of ``dtypes`` runs in this kernel: one of
    ``DTYPES`` on a CPU (dtypes as torch dtypes, or their names as a config writes them)."""
    names = {str(d).removeprefix("torch.") for d in dtypes}
    return torch.device(device).type == "cpu" and len(names) == 1 and names <= set(DTYPES)


def registered() -> bool:
    """Whether this process has the op's CPU kernel (from a build, or an artifact's library)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(OP, "CPU")


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), or nothing where /proc/cpuinfo does not list them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


@functools.cache
def build() -> Path:
    """The shared library's path, built first if this machine has no build of this source for
    this torch and CPU (in torch's extension directory). A built one is found by name alone:
    ``nb compile`` calls this every run, and probing the vector ISA costs seconds."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__} {_cpu_flags()}".encode())
    name = f"nb_block_kv_cpu_{digest.hexdigest()[:12]}"
    directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    library = directory / f"{name}.so"
    if library.is_file():
        return library
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()  # what inductor vectorises its own CPU kernels for, on this machine
    # -fopenmp: at::parallel_for is inlined here, and without it runs on one thread
    flags = ["-O3", "-fopenmp", *(f"-D{m}" for m in isa.build_macro()), *isa.build_arch_flags().split()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(directory), is_python_module=False)
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"cannot build nb's CPU attention kernel {SOURCE.name} (needs a C++ compiler "
                           f"and torch's headers): {first}") from e
    return library


def register(library: Path) -> None:
    """Load an artifact's copy of the built kernel, unless this process already has the op's kernel
    (a second registration of the same op is an error)."""
    if not registered():
        torch.ops.load_library(str(library))


def block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """An ``AttentionKernel``: the inputs, output and masking of ``block_kv_torch.block_kv_attention``."""
    if not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or registered()):
        register(build())  # eager calls outside an artifact (tests, references)
    return torch.ops.nb.block_kv_attention(
        q, k_active, v_active, k_cache, v_cache, *step, scale, window
    )
