"""LoRA adapters on the server, vLLM's interface: a request's ``model`` names an adapter,
``/v1/models`` lists them with their ``parent``, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` change them at run time (behind the API key, as every ``/v1`` route),
and ``/metrics`` counts requests per adapter and the adapters swapped into a slot.

Loading reads and checks the adapter on the engine thread between two steps; it compiles nothing
(the slots are graph inputs), and requests may name it as soon as the call returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict

from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.lora_pool import AdapterPool
from neuron_buckets.server.engine_loop import EngineLoop
from neuron_buckets.server.openai_protocol import ModelCard


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what nb goes by


def adapter_of(engine: LLMEngine, requested: str | None) -> str | None:
    """The adapter a request's ``model`` names, None when it names none (the base model's name,
    another model's, or no name: ``check_model`` judges those)."""
    return requested if requested is not None and requested in engine.adapters.adapters else None


def adapter_cards(engine: LLMEngine, base: ModelCard) -> list[ModelCard]:
    """``/v1/models``'s entry of each adapter, its ``parent`` the base model."""
    return [ModelCard(id=name, created=base.created, max_model_len=base.max_model_len, root=adapter.digest,
                      parent=base.id) for name, adapter in sorted(engine.adapters.adapters.items())]


def lora_routes(v1: APIRouter, engine: LLMEngine, loop: EngineLoop) -> None:
    """Add the load and unload routes; a refused adapter is a 400, an unknown name a 404."""
    async def on_engine_thread(command: Callable[[], object]) -> None:
        await asyncio.wrap_future(loop.between_steps(command))

    @v1.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load(body: LoadLoraAdapterRequest) -> str:
        await on_engine_thread(lambda: engine.adapters.add(body.lora_name, body.lora_path))
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @v1.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload(body: UnloadLoraAdapterRequest) -> str:
        await on_engine_thread(lambda: engine.adapters.remove(body.lora_name))
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


class AdapterCollector(Collector):
    """Per-adapter request counters, the adapters loaded and the swaps into a slot, read when
    Prometheus scrapes."""

    def __init__(self, model_name: str, pool: Callable[[], AdapterPool]) -> None:
        self.model_name, self.pool = model_name, pool

    def collect(self) -> Iterator[Metric]:
        pool = self.pool()
        requests = CounterMetricFamily("nb:lora_requests", "Requests admitted per LoRA adapter",
                                       labels=["model_name", "lora_name"])
        for name, count in sorted(pool.requests.items()):
            requests.add_metric([self.model_name, name], count)
        swaps = CounterMetricFamily("nb:lora_slot_swaps", "Adapters copied into a slot that held another",
                                    labels=["model_name"])
        swaps.add_metric([self.model_name], pool.swaps)
        loaded = GaugeMetricFamily("nb:lora_adapters_loaded", "LoRA adapters loaded (host pool)",
                                   labels=["model_name"])
        loaded.add_metric([self.model_name], len(pool.adapters))
        yield from (requests, swaps, loaded)
