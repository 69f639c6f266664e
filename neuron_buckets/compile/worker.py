"""What runs inside one ``nb compile`` worker process: build one piece, compile it.

Workers are spawned (a clean interpreter, no inherited locks or threads) and get only picklable
inputs; each writes its graph into the shared cache under a temp name and renames it when done.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

from neuron_buckets.backends import get_backend
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.config import Config
from neuron_buckets.model.checkpoint import model_config_of
from neuron_buckets.model.pieces import PIECES, PieceShape, dynamic_shapes, example_inputs


def compile_piece(config: Config, shape: PieceShape, key: str, store_root: str) -> tuple[float, str | None]:
    """Runs in a worker process: build one piece from the model config alone, compile it into
    the cache. No weights are read: pieces take them as inputs, so zeros of their shapes trace."""
    backend = get_backend(config.compile.backend)
    store = GraphStore(Path(store_root))
    device = config.compile.device
    model_config = model_config_of(config.model.path)
    piece = PIECES[shape.role](model_config).to(device)
    example = example_inputs(
        shape, model_config, config.cache.block_size, config.cache.num_blocks,
        getattr(torch, config.cache.dtype), device,
    )
    temp = store.temp_path(key, backend.graph_ext)
    start = time.perf_counter()
    try:
        backend.compile(piece, example, temp, config.compile.flags, dynamic_shapes(shape))
        store.commit(temp, key, backend.graph_ext, time.perf_counter() - start)
    except Exception:
        temp.unlink(missing_ok=True)
        return time.perf_counter() - start, traceback.format_exc()
    return time.perf_counter() - start, None


def init_worker(threads: int) -> None:
    torch.set_num_threads(threads)
    # torch's own pickling of export specs trips its own deprecation on every compile; it says
    # nothing a user can act on and would scroll the progress bar away.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
    # A worker must not outlive nb compile: killed with SIGKILL it cannot stop its pool, whose
    # workers would otherwise compile on, then wait forever for work.
    parent = mp.parent_process()
    threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()
