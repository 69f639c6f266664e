"""What runs inside one ``nb compile`` worker process: rebuild the model, compile one bucket.

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
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.core.padding import PrefillChunk, pad_decode, pad_prefill
from neuron_buckets.model.checkpoint import build_model
from neuron_buckets.model.llama import Llama


def example_args(model: Llama, bucket: Bucket, config: Config, device: str) -> tuple[torch.Tensor, ...]:
    """Inputs of the bucket's exact shapes (one real token, the rest padding) plus the caches."""
    pad = pad_decode if bucket.kind == "decode" else pad_prefill
    step = pad([PrefillChunk([0], 0, [1])], bucket, config.cache.block_size)
    shape = model.cache_shape(config.cache.num_blocks, config.cache.block_size)
    dtype = getattr(torch, config.cache.dtype)
    caches = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    return tuple(t.to(device) for t in (*step.args(), *caches))


def compile_bucket(config: Config, bucket: Bucket, key: str, store_root: str) -> tuple[float, str | None]:
    """Runs in a worker process: rebuild the model, compile one bucket into the cache."""
    backend = get_backend(config.compile.backend)
    store = GraphStore(Path(store_root))
    device = config.compile.device
    model = build_model(config.model.path, getattr(torch, config.cache.dtype)).to(device)
    temp = store.temp_path(key, backend.graph_ext)
    start = time.perf_counter()
    try:
        backend.compile(model, example_args(model, bucket, config, device), temp, config.compile.flags)
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
