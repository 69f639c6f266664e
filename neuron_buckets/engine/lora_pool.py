"""Adapters by name for one runtime's LoRA slots: held in host memory, copied into a slot on demand.

Every registered adapter is read once (``runtime/lora_adapter.py``) and kept on the host, named
by its content: two names of the same bytes are one adapter and share a slot. A request of an
adapter takes a slot when the scheduler admits it (``acquire``) and gives it back when it ends or
is preempted (``release``). An adapter already in a slot is reused; else it goes into a free
slot, or into the least recently used slot no running request holds (a swap, counted for
``/metrics``). With every slot held by running requests of other adapters, the request waits,
as it waits for KV blocks. Slot 0 is the base model and never changes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from pathlib import Path

from neuron_buckets.engine.request import Request
from neuron_buckets.engine.request_check import RequestError
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.runtime.lora_adapter import AdapterError, LoraAdapter, read_adapter
from neuron_buckets.runtime.lora_slots import LoraSlots


class UnknownAdapter(RequestError):
    """A request or an unload naming no registered adapter (a 404 on the server)."""


class AdapterPool:
    def __init__(self, runtime: BucketRuntime) -> None:
        self.runtime = runtime
        self.adapters: dict[str, LoraAdapter] = {}  # by name
        self._slot_of: dict[str, int] = {}  # digest -> the slot holding it
        self._held: Counter[int] = Counter()  # slot -> running requests on it
        self._idle: OrderedDict[int, None] = OrderedDict()  # filled slots nobody holds, LRU first
        self.swaps = 0  # adapters copied into a slot that held another
        self.requests: Counter[str] = Counter()  # requests admitted, by adapter name

    @property
    def slots(self) -> LoraSlots:
        """The runtime's slots; one line (``AdapterError``) for an artifact without."""
        if self.runtime.lora is None:
            raise self._no_slots()
        return self.runtime.lora

    def _no_slots(self) -> AdapterError:
        return AdapterError(f"{self.runtime.directory} has no LoRA slots: compile it with a [lora] section "
                            "(lora.max_loras > 0) to serve adapters")

    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Register adapter ``name`` from a PEFT directory; one line (``AdapterError``) if the
        artifact's slots cannot hold it or the name is taken by other weights."""
        slots, dtype = self.slots, self.runtime.k_cache.dtype
        adapter = read_adapter(name, Path(path), self.runtime.config, slots.shape, dtype)
        if (old := self.adapters.get(name)) is not None and old.digest != adapter.digest:
            raise AdapterError(f"adapter {name!r} is loaded already, with other weights; unload it first")
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        """Forget adapter ``name``; requests running on it finish with the slot they hold."""
        adapter = self.get(name)
        del self.adapters[name]
        if adapter.digest not in {a.digest for a in self.adapters.values()}:
            slot = self._slot_of.pop(adapter.digest, None)
            if slot is not None and not self._held[slot]:
                self._idle.pop(slot, None)

    def get(self, name: str) -> LoraAdapter:
        """The adapter registered as ``name``, or one line: unknown, or no slots to serve it."""
        if (adapter := self.adapters.get(name)) is not None:
            return adapter
        if self.runtime.lora is None:
            raise self._no_slots()
        raise UnknownAdapter(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters)}")

    def acquire(self, req: Request) -> bool:
        """Give ``req`` its adapter's slot, copying the adapter in if needed; False when every slot
        is held by running requests of other adapters (it waits). A base request needs none."""
        if req.lora is None:
            return True
        adapter = self.get(req.lora)
        slot = self._slot_of.get(adapter.digest)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self.slots.fill(slot, adapter)
            self._slot_of[adapter.digest] = slot
        self._idle.pop(slot, None)
        self._held[slot] += 1
        self.requests[req.lora] += 1
        req.lora_slot = slot
        return True

    def release(self, req: Request) -> None:
        """``req`` left the running requests: its slot may be reused once nobody holds it."""
        slot, req.lora_slot = req.lora_slot, 0
        if not slot:
            return
        self._held[slot] -= 1
        if not self._held[slot]:
            del self._held[slot]
            if slot in self._slot_of.values():
                self._idle[slot] = None

    def _free_slot(self) -> int | None:
        """A slot no adapter fills and no request holds (an unloaded adapter's requests may run on
        yet), else the least recently used one nobody holds (its adapter out)."""
        used = {*self._slot_of.values(), *self._held}
        if fresh := [s for s in range(1, self.slots.shape.max_loras + 1) if s not in used]:
            return fresh[0]
        if not self._idle:
            return None
        slot, _ = self._idle.popitem(last=False)
        del self._slot_of[next(d for d, s in self._slot_of.items() if s == slot)]
        self.swaps += 1
        return slot
