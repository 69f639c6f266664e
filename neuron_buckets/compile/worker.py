"""What one compile worker runs: build one piece, compile it, publish it to the graph store.

The same function runs in a local worker process and as a Ray task on any node, so its input is
one picklable ``CompileTask`` and the store is named by its location (a path or a URL). A node
must compile what the driver's key describes: one with other sources or toolchain versions
refuses, instead of publishing a different graph under that key. Nothing is published unless the
compile finished, so a failure is never cached.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from neuron_buckets._version import __version__
from neuron_buckets.backends import Backend, get_backend
from neuron_buckets.compile.cache_key import backend_source_digest
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_entry import StoreEntry
from neuron_buckets.config import Config
from neuron_buckets.model.lora import LoraShape, adapt, example_lora_inputs
from neuron_buckets.model.model_source import model_config_of
from neuron_buckets.model.pieces import PieceShape, build_piece, dynamic_shapes, example_inputs
from neuron_buckets.model.tp.tensor_parallel import TensorParallel
from neuron_buckets.utils.files import sha256_file


@dataclass(frozen=True)
class Toolchain:
    """What a key was computed with, beyond the config: the graph-shaping sources and the
    backend's versions."""

    sources: str
    versions: dict[str, str]


@dataclass(frozen=True)
class CompileTask:
    config: Config
    shape: PieceShape
    key: str
    store: str  # where the graph is published: the shared store's URL, or the local cache's path
    mirror: str | None  # this machine's local cache, given the graph too (None on other nodes)
    toolchain: Toolchain  # the driver's
    threads: int  # torch threads for the compile


class ToolchainMismatch(RuntimeError):
    """This worker would compile something else than the key says."""


def compile_piece(
    task: CompileTask, before_publish: Callable[[], None] | None = None
) -> tuple[float, str | None]:
    """Compile one piece and publish it; returns (seconds, the traceback if it failed).

    The piece is built from the model config alone, at one rank's shapes: pieces take weights as
    inputs, so zeros of their shapes trace, and no weights are read. ``before_publish`` is a test
    hook, called with the graph built and not yet published: a fixed point where a test's worker
    dies or hangs, instead of a kill racing the compile (an executor's ``run`` swaps in such a
    worker)."""
    torch.set_num_threads(task.threads)
    # torch's own pickling of export specs trips its own deprecation on every compile; it says
    # nothing a user can act on and would scroll the progress bar away.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
    start = time.perf_counter()
    try:
        config, shape = task.config, task.shape
        backend = get_backend(config.compile.backend)
        _check_toolchain(backend, task.toolchain)
        store = GraphStore(task.store)
        mirror = GraphStore(task.mirror) if task.mirror else None
        model_config = model_config_of(config.model.path)
        tp = TensorParallel(config.parallel.tensor_parallel_size)
        lora = LoraShape.of(config.lora.max_loras, config.lora.max_lora_rank, config.lora.target_modules)
        piece = adapt(build_piece(shape.role, model_config, tp), lora).to(config.compile.device)
        dtype = getattr(torch, config.cache.dtype)
        example = example_inputs(
            shape, tp.local(model_config), config.cache.block_size, config.cache.num_blocks, dtype,
            config.compile.device,
        )
        if lora is not None and shape.role == "layer":
            tokens = shape.tokens
            example += example_lora_inputs(lora, model_config, tokens, dtype, config.compile.device)
        with (mirror or store).scratch() as scratch, tp.tracing():
            graph = scratch / f"{task.key}.{backend.graph_ext}"  # a fixed name: packages embed it
            backend.compile(piece, example, graph, config.compile.flags, dynamic_shapes(shape))
            seconds = time.perf_counter() - start
            entry = StoreEntry(
                key=task.key, ext=backend.graph_ext, sha256=sha256_file(graph), bytes=graph.stat().st_size,
                compile_seconds=round(seconds, 3), piece=shape.name, backend=backend.name,
                versions=task.toolchain.versions, toolchain=__version__, created=time.time(),
            )
            if before_publish:
                before_publish()
            held = store.publish(graph, entry)
            if mirror and held.sha256 == entry.sha256:
                mirror.publish(graph, entry)
    except Exception:
        return time.perf_counter() - start, traceback.format_exc()
    return seconds, None


def _check_toolchain(backend: Backend, expected: Toolchain) -> None:
    here = Toolchain(backend_source_digest(backend), backend.versions())
    if here.sources != expected.sources:
        raise ToolchainMismatch(
            "this node's neuron-buckets sources differ from the compiling driver's; install the same "
            "version on every node"
        )
    if here.versions != expected.versions:
        raise ToolchainMismatch(f"this node has {here.versions}, the driver {expected.versions}")


def watch_parent() -> None:
    """Initializer of local worker processes: a worker must not outlive nb compile. Killed with
    SIGKILL, nb compile cannot stop its pool, whose workers would otherwise compile on, then wait
    forever for work."""
    parent = mp.parent_process()
    threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()
