"""The ranks of a tensor-parallel artifact: one process each, joined by torch.distributed (gloo).

Rank 0 is the process that opened the artifact: it runs the engine (scheduler and sampler) and
hands every step plan to the other ranks, which run the same graph calls on their shards; the
collectives inside the pieces join them. Started on one machine, rank 0 spawns the others
(``python -m neuron_buckets.runtime.rank_worker``) on a free local port. Across machines every
rank is started by hand or by torchrun with torch.distributed's own rendezvous variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``): rank 0 runs ``nb serve`` or
``nb generate``, the others the worker module (README, "Tensor parallelism").

Plans travel through the group's TCP store, not a gloo broadcast: a rank waiting for the next
step of an idle server would otherwise sit in a collective past gloo's timeout, and that timeout
is what keeps a hung rank from hanging the others (``timeout``: ``NB_RANK_TIMEOUT_S`` seconds,
60 unless set). A rank that dies closes its sockets, so the others' next collective fails at once
(``RankLost``) and rank 0's engine stops. Leaving a group (``close``, ``abandon``) leaves nothing
of it in this process: its followers are reaped, its process group destroyed and its store (and
the port it holds) released, so the same process can open another tensor-parallel artifact.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from neuron_buckets.core.step_plan import Segment, StepPlan
from neuron_buckets.model.tp.tensor_parallel import GROUP

# How long a collective (a step's all-reduce) or a store wait may take before the rank gives up:
# a step's ranks meet every layer, so only a hung (or badly starved) rank comes near it. Rank 0
# passes its environment to the followers it spawns, so they wait as long.
TIMEOUT_ENV = "NB_RANK_TIMEOUT_S"
TIMEOUT = timedelta(seconds=60)
# A follower's wait for the next plan: an idle server sends none, and each wait that runs out logs a
# line; rank 0 gone ends the wait at once (its store's socket closes).
POLL = timedelta(hours=1)
# How long the ranks may take to start (imports, artifact checks) before they form the group, and
# then to load their shards and graphs before the first step.
START = timedelta(minutes=10)
ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
STOP = b""  # the plan that ends the followers
FIELDS = 5  # request_id, context_len, num_samples, tokens, blocks: per segment


class RankLost(RuntimeError):
    """Another rank of the group died or stopped answering: no step can run any more."""

    def __init__(self, what: str, cause: BaseException | None = None) -> None:
        # torch's distributed errors carry a C++ backtrace after their first line
        super().__init__(what if cause is None else f"{what}: {str(cause).splitlines()[0]}")


def encode(plan: StepPlan) -> bytes:
    """A plan as one int64 tensor's bytes: a header row per segment, then tokens, then blocks."""
    head = [[s.request_id, s.context_len, s.num_samples, len(s.token_ids), len(s.block_ids)] for s in plan]
    parts = [torch.tensor(head, dtype=torch.int64).flatten()]
    parts += [torch.as_tensor(s.token_ids, dtype=torch.int64).flatten() for s in plan]
    parts += [torch.as_tensor(s.block_ids, dtype=torch.int64) for s in plan]
    return torch.cat([torch.tensor([len(plan)]), *parts]).numpy().tobytes()


def decode(data: bytes) -> StepPlan:
    """``encode``'s plan back."""
    flat = torch.frombuffer(bytearray(data), dtype=torch.int64)
    n = int(flat[0])
    head = flat[1 : 1 + FIELDS * n].view(n, FIELDS).tolist()
    lengths = [h[3] for h in head] + [h[4] for h in head]
    pieces = flat[1 + FIELDS * n :].split(lengths)
    return tuple(
        Segment(rid, pieces[i], ctx, pieces[n + i].tolist(), samples)
        for i, (rid, ctx, samples, _, _) in enumerate(head)
    )


def timeout() -> timedelta:
    """``NB_RANK_TIMEOUT_S`` seconds, else ``TIMEOUT``; unless a positive number, a ``ValueError``
    (a user's mistake: the command line shows it as one line)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} is {raw!r}: give the seconds a step's collective may wait (> 0)")
    return timedelta(seconds=seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """This process's place among the ranks; rank 0 sends plans, the others receive them."""

    # Ranks load every graph, then wait for each other: one loading a graph on first use
    # mid-step, or its shard after the others' first step began, would keep them waiting in a
    # collective, towards its timeout.
    preloads = True

    def __init__(self, rank: int, size: int, store: dist.Store, workers: list[subprocess.Popen],
                 wait: timedelta = TIMEOUT) -> None:
        self.rank, self.size, self.workers, self.wait = rank, size, workers, wait
        self.store: dist.Store | None = store  # None once this process has left the group
        self.step = 0

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, directory: Path, size: int) -> RankGroup:
        """Join the group of ``size`` ranks: as the rank the environment names (set by torchrun,
        by hand, or by a rank 0 that spawned this one), else as rank 0, spawning the others here.
        A join that fails leaves nothing behind: the ranks it spawned are reaped, the process
        group it made is destroyed."""
        wait = timeout()
        env = {k: os.environ.get(k) for k in ENV}
        workers: list[subprocess.Popen] = []
        if env["RANK"] is None:
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(size)}
            workers = [_spawn(directory, {**env, "RANK": str(r)}) for r in range(1, size)]
            env["RANK"] = "0"
        initialized = False
        try:
            rank, world = int(env["RANK"] or 0), int(env["WORLD_SIZE"] or 0)
            if world != size:
                raise RankLost(f"WORLD_SIZE is {world}, but the artifact has tensor_parallel_size {size}")
            # Under torchrun its agent hosts the store on MASTER_PORT; every rank is its client.
            hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            store = dist.TCPStore(env["MASTER_ADDR"] or "", int(env["MASTER_PORT"] or 0), size, hosts,
                                  timeout=wait, wait_for_workers=False)
            _meet(store, "arrived", size, workers, "start")
            dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank,
                                    world_size=size, timeout=wait)
            initialized = True
            if dist.group.WORLD.group_name != GROUP:
                raise RankLost(f"the world process group is named {dist.group.WORLD.group_name!r}, not "
                               f"{GROUP!r}: open a tensor-parallel artifact before creating other groups")
        except (RuntimeError, ValueError) as e:  # RankLost too
            _end(workers, wait)
            if initialized:
                dist.destroy_process_group()
            raise e if isinstance(e, RankLost) else RankLost(f"cannot join the {size} ranks", e) from None
        group = cls(rank, size, dist.PrefixStore("nb", store), workers, wait)
        if group.leads:
            atexit.register(group.close)
        return group

    def loaded(self) -> None:
        """Wait for every rank to have loaded its shard and graphs: the first step's collectives
        would otherwise wait ``timeout`` for a rank that is still loading (one started later, or
        slower on a busy machine), and fail the step."""
        try:
            _meet(self._store(), "loaded", self.size, self.workers, "load the artifact")
        except RuntimeError as e:  # the store itself failed: rank 0, its host, is gone
            raise e if isinstance(e, RankLost) else RankLost("the ranks' store failed", e) from None

    @contextmanager
    def in_step(self) -> Iterator[None]:
        """A step that fails leaves the ranks out of step (a rank died, a collective timed out), so
        no later step can run: the group is abandoned and the failure is ``RankLost``."""
        try:
            yield
        except Exception as e:
            self.abandon()
            raise RankLost(f"a step failed across the {self.size} ranks", e) from e

    def send(self, plan: StepPlan) -> None:
        """Rank 0: hand the followers the plan it is about to run."""
        self._put(encode(plan))

    def _store(self) -> dist.Store:
        if self.store is None:
            raise RankLost(f"this process has left the group of {self.size} ranks")
        return self.store

    def _put(self, data: bytes) -> None:
        store = self._store()
        self.step += 1
        try:
            store.set(f"plan{self.step}", data)
            if self.step > 1:  # every follower ran the previous step's collectives: it read it
                store.delete_key(f"plan{self.step - 1}")
        except RuntimeError as e:
            raise RankLost("the ranks' store failed", e) from None

    def receive(self) -> StepPlan | None:
        """A follower: the next plan, or None when rank 0 ends the group."""
        store = self._store()
        self.step += 1
        key = f"plan{self.step}"
        while True:
            try:
                store.wait([key], POLL)
                data = store.get(key)
                if data != STOP:
                    return decode(data)
                with contextlib.suppress(RuntimeError):  # rank 0 may already be gone
                    store.add("stopped", 1)  # rank 0 may now drop the store
                return None
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():  # not just an idle server: rank 0 is gone
                    raise RankLost("rank 0 is gone", e) from None

    def close(self) -> None:
        """Rank 0: end the followers (they exit, each given ``timeout``), then leave the group.
        Followers started elsewhere (torchrun, by hand) count themselves out in the store once
        they have read the plan that ends them: the store goes with the group, and a follower
        still reading from it would take that for rank 0 lost."""
        if not self.leads or self.store is None:
            return
        with contextlib.suppress(RuntimeError):  # RankLost, or the store failing under _meet
            self._put(STOP)
            if not self.workers:
                _meet(self.store, "stopped", self.size, [], "stop", self.wait)
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.wait(self.wait.total_seconds())
        self.abandon()  # a follower still running then is killed there

    def abandon(self) -> None:
        """After a failed step, when no step can run again: end the ranks this one spawned at once
        (they may sit in a collective) and reap them, destroy the process group, and drop the
        store (rank 0's holds a port): nothing of the group is left in this process, so it can
        open another tensor-parallel artifact, and its exit waits for nothing. Once only: the
        process group a later group makes is not this one's to destroy."""
        if self.store is None:
            return
        self.store = None
        atexit.unregister(self.close)
        _end(self.workers, self.wait)
        if dist.is_initialized():
            dist.destroy_process_group()


def _end(workers: list[subprocess.Popen], wait: timedelta) -> None:
    """Kill the ranks this process spawned and reap them, each given ``wait`` to die (a process
    stuck in the kernel may outlive SIGKILL a while; it is then left, not waited for forever)."""
    for w in workers:
        w.kill()
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.wait(wait.total_seconds())


def _meet(store: dist.Store, key: str, size: int, workers: list[subprocess.Popen], what: str,
          within: timedelta = START) -> None:
    """Wait, up to ``within``, for every rank to count itself in at ``key``: gloo's own rendezvous
    (and a step's collective) would give a rank still importing torch or loading its shard only
    ``timeout``. A rank this one spawned that exits ends the wait."""
    store.add(key, 1)
    deadline = time.monotonic() + within.total_seconds()
    while store.add(key, 0) < size:
        if any(w.poll() is not None for w in workers):
            raise RankLost(f"a rank exited before the ranks could {what}")
        if time.monotonic() > deadline:
            raise RankLost(f"the {size} ranks did not all {what} within {within.total_seconds():.0f} s")
        time.sleep(0.1)


def _spawn(directory: Path, env: dict[str, str]) -> subprocess.Popen:
    """A follower rank on this machine, its output beside this process's."""
    cmd = [sys.executable, "-m", "neuron_buckets.runtime.rank_worker", str(directory)]
    return subprocess.Popen(cmd, env={**os.environ, **env})
