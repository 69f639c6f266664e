"""Will an artifact fit in memory? Checked before any worker starts and before the runtime
allocates its cache, so an impossible size fails at once with the number instead of every bucket
failing with "tried to allocate 8 TB", or an artifact compiling that can never generate.

Serving needs the weights, the KV cache (num_blocks x geometry x dtype, K and V) and the
activations of the largest step; each compile job holds the weights and the example caches.
Estimates count only the largest tensors, so they are lower bounds: a refusal is certain, a pass
is not a promise. Available memory is the host's (``MemAvailable``), so only CPU devices are
checked.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from neuron_buckets.config.config import Config
from neuron_buckets.config.grid import enumerate_grid
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.tp.tensor_parallel import TensorParallel

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
FLOAT32 = 4  # attention scores and logits are float32 whatever the dtype


class InsufficientMemory(ValueError):
    """The configured sizes cannot fit in this machine's memory."""


def available_bytes() -> int | None:
    """Memory the host can still give (MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def cache_bytes(model: LlamaConfig, num_blocks: int, block_size: int, dtype: str) -> int:
    """K and V caches: layers x blocks x block_size x kv heads x head_dim, twice."""
    per_slot = model.num_layers * model.num_kv_heads * model.head_dim * DTYPE_BYTES[dtype]
    return 2 * num_blocks * block_size * per_slot


def weights_bytes(model: LlamaConfig, dtype: str) -> int:
    """The weights a runtime holds: a quantized model's projections at their runtime width
    (``QuantScheme.runtime_bytes``), with a float32 scale per output channel (and one per
    projection for its input, where the scheme has static activations)."""
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    e, i, s = DTYPE_BYTES[dtype], model.intermediate_size, model.quantization
    projections = h * (2 * q + 2 * kv) + 3 * h * i
    if s is None:
        projection_bytes = projections * e
    else:
        scales = q + 2 * kv + h + 2 * i + h + (4 if s.static_input else 0)  # 4: qkv, o, gate_up, down
        projection_bytes = projections * s.runtime_bytes(e) + scales * FLOAT32
    heads = 1 if model.tie_word_embeddings else 2
    norms = model.num_layers * 2 * h + h
    return (heads * model.vocab_size * h + norms) * e + model.num_layers * projection_bytes


def step_bytes(model: LlamaConfig, bucket: Bucket, dtype: str) -> int:
    """The largest activations of one step, in one layer at a time.

    Attention gathers each row's context K and V (masked, then joined with the step's own) and
    scores every query against it in float32 (scores, mask, softmax); the MLP holds three
    ``intermediate_size`` tensors; the logits are float32 per sampled token.
    """
    e = DTYPE_BYTES[dtype]
    # A packed prefill step is one row of all its tokens; a decode step one row per request.
    tokens = bucket.tokens
    rows, per_row = (1, tokens) if bucket.kind == "prefill" else (bucket.batch, bucket.seq)
    keys = bucket.ctx + per_row
    context = 4 * rows * keys * model.num_kv_heads * model.head_dim * e
    scores = 3 * rows * model.num_heads * per_row * keys * FLOAT32
    mlp = 3 * tokens * model.intermediate_size * e
    samples = tokens if bucket.kind == "decode" else bucket.batch
    hidden = 4 * tokens * model.hidden_size * e
    return max(context + scores, mlp) + hidden + samples * model.vocab_size * FLOAT32


def serving_needs(
    model: LlamaConfig, buckets: Iterable[Bucket], num_blocks: int, block_size: int, dtype: str
) -> dict[str, int]:
    """What generating from an artifact holds at once, by part."""
    largest = max(buckets, key=lambda b: step_bytes(model, b, dtype))
    return {
        "the KV cache": cache_bytes(model, num_blocks, block_size, dtype),
        "the weights": weights_bytes(model, dtype),
        f"the largest step ({largest.name})": step_bytes(model, largest, dtype),
    }


SMALLER = "lower cache.num_blocks, cache.max_model_len or the bucket sizes"


def check_memory(needs: dict[str, int], purpose: str, hint: str = SMALLER) -> None:
    """Refuse ``purpose`` when its ``needs`` exceed the available memory, with the numbers."""
    available = available_bytes()
    total = sum(needs.values())
    if available is not None and total > available:
        parts = ", ".join(f"{name} {human(n)}" for name, n in needs.items())
        raise InsufficientMemory(
            f"{purpose} needs at least {human(total)} of memory ({parts}), but {human(available)} is "
            f"available; {hint}"
        )


def rank_model(config: Config, model: LlamaConfig) -> LlamaConfig:
    """The shapes one rank of ``config``'s tensor-parallel degree holds and computes."""
    return TensorParallel(config.parallel.tensor_parallel_size).local(model)


def compile_job_bytes(config: Config, model: LlamaConfig) -> int:
    """What one compile job holds at least: the example KV cache and the weights' shapes (one
    rank's: a piece is compiled at one rank's shapes)."""
    c, model = config.cache, rank_model(config, model)
    return cache_bytes(model, c.num_blocks, c.block_size, c.dtype) + weights_bytes(model, c.dtype)


def check_compile_memory(config: Config, model: LlamaConfig, jobs: int) -> None:
    """Before compiling: the artifact must be servable here, and the ``jobs`` compiling on this
    machine must fit side by side (0 when they run elsewhere, as Ray tasks)."""
    if config.compile.device != "cpu":
        return
    c, local = config.cache, rank_model(config, model)
    needs = serving_needs(local, enumerate_grid(config), c.num_blocks, c.block_size, c.dtype)
    ranks = config.parallel.tensor_parallel_size
    check_memory(needs, "generating from this config" + (f" (each of {ranks} ranks)" if ranks > 1 else ""))
    needs = {f"{jobs} jobs x (example KV cache and weights)": jobs * compile_job_bytes(config, model)}
    check_memory(needs, "compiling", f"use fewer --jobs or {SMALLER}")


def ranks_report(model: LlamaConfig, tensor_parallel_size: int, buckets: Iterable[Bucket], num_blocks: int,
                 block_size: int, dtype: str, graphs: int) -> dict:
    """What ``nb compile --dry-run`` and ``nb inspect --manifest`` say of the ranks: the degree,
    the graphs that serve all of them (as many as at one rank), and one rank's memory by part."""
    local = TensorParallel(tensor_parallel_size).local(model)
    needs = serving_needs(local, buckets, num_blocks, block_size, dtype)
    return {"tensor_parallel_size": tensor_parallel_size, "graphs": graphs, "memory_per_rank": needs}


def ranks_line(report: dict) -> str:
    """``ranks_report`` as one line."""
    parts = ", ".join(f"{name} {human(n)}" for name, n in report["memory_per_rank"].items())
    n = report["tensor_parallel_size"]
    return f"{report['graphs']} graphs serve {'all ' + str(n) + ' ranks' if n > 1 else 'the one rank'}; " \
           f"memory per rank at least: {parts}"
