"""Pieces as Ray tasks across a cluster: ``nb compile --executor ray [--ray-address ADDR]``.

Each task declares the CPUs (``compile.task_cpus``) and the memory (weights plus example caches)
one compile needs, so Ray places it on a node that has them; as many run at once as the cluster
holds. Ray's own retries are off: a task whose worker or node died comes back to the compiler,
which retries it ``compile.retries`` times as it does for local workers, then records it failed
with the reason. Ray is an optional extra; without it the message says how to install it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from neuron_buckets.compile.executor import Submit
from neuron_buckets.compile.worker import CompileTask, compile_piece
from neuron_buckets.runtime.memory import human
from neuron_buckets.utils.errors import UserError

INSTALL = "pip install 'neuron-buckets[ray]' (the same Ray version on every node)"
CONNECT_TIMEOUT_S = 10


class RayUnavailable(UserError, RuntimeError):
    """Ray is not installed, or the cluster cannot be reached or cannot run a compile task."""


def check_ray(address: str | None) -> Any:
    """Ray, importable, and the cluster at ``address`` listening: checked before a compile starts.
    Ray itself waits minutes for a cluster that is not there; a plain TCP connect says so at once."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(f"--executor ray needs Ray, which is not installed ({e}); {INSTALL}") from None
    host, _, port = (address or "").rpartition(":")
    if host and "://" not in address and port.isdigit():  # not "auto", "local" or a ray:// client
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise RayUnavailable(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None
    return ray


class RayExecutor:
    on_this_host = False
    run = staticmethod(compile_piece)  # what a task runs; tests swap in one that stops mid-compile

    def __init__(self, address: str | None, task_cpus: int, task_bytes: int, store_is_local: bool) -> None:
        self.ray = check_ray(address)
        # Workers' output would tear the progress bar; a failure's traceback comes back as its result.
        self.ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        try:
            nodes = [n for n in self.ray.nodes() if n["Alive"]]
            free = [n["Resources"] for n in nodes]
            self.slots = sum(
                min(int(r.get("CPU", 0) // task_cpus), int(r.get("memory", 0) // task_bytes)) for r in free
            )
            if not self.slots:
                raise RayUnavailable(
                    f"no node of the Ray cluster has {task_cpus} CPUs and {human(task_bytes)} of memory free "
                    "for one compile task; lower compile.task_cpus or add nodes"
                )
            hosts = {n["NodeManagerAddress"] for n in nodes}
            if store_is_local and hosts != {self.ray.util.get_node_ip_address()}:
                raise RayUnavailable(
                    f"the Ray cluster spans {len(hosts)} hosts, but --cache-dir is a local directory; give "
                    "a URL every node reaches (s3://bucket/prefix, or file:///path on a shared filesystem)"
                )
        except BaseException:
            self.ray.shutdown()
            raise
        self.threads = task_cpus
        self.remote = self.ray.remote(num_cpus=task_cpus, memory=task_bytes, max_retries=0)(self.run)

    @contextmanager
    def pool(self) -> Iterator[Submit]:
        refs = []

        def submit(task: CompileTask):
            refs.append(ref := self.remote.remote(task))
            return ref.future()

        try:
            yield submit
        except BaseException:  # stopped (Ctrl-C, an error): tasks still queued must not run on
            for ref in refs:
                self.ray.cancel(ref, force=True)
            raise

    def died(self, error: BaseException) -> bool:
        e = self.ray.exceptions
        return isinstance(error, e.WorkerCrashedError | e.NodeDiedError | e.LocalRayletDiedError
                          | e.OutOfMemoryError)

    def close(self) -> None:
        self.ray.shutdown()
