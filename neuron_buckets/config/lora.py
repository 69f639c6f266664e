"""``[lora]``: the adapter slots the layer pieces take (vLLM's names).

``max_loras`` slots (0: off) of ``max_lora_rank`` each, for the projections ``target_modules``
names (PEFT's module names). They shape the layer pieces' inputs, so all three enter the layer's
cache key; the adapters themselves are inputs filled at run time (``model/lora.py``), so an adapter
never needs a compile and a LoRA artifact has no more buckets than one without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.setting import DECODES, check_positive, check_types, setting

# PEFT's names of a Llama-family layer's projections, in the layer's order.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    SECTION: ClassVar[str] = "lora"

    max_loras: int = setting(0, graph=True, tasks=DECODES)  # adapter slots; 0: no LoRA
    max_lora_rank: int = setting(16, graph=True, tasks=DECODES)
    target_modules: list[str] = setting(graph=True, factory=lambda: list(TARGETS), tasks=DECODES)

    def __post_init__(self) -> None:
        check_types(self)
        check_positive(self, "max_lora_rank")
        t = self.target_modules
        if not isinstance(t, list) or not t or any(m not in TARGETS for m in t) or len(set(t)) != len(t):
            raise ConfigError(f"lora.target_modules must be a non-empty list of distinct names of "
                              f"{list(TARGETS)}, got {t!r}")
        object.__setattr__(self, "target_modules", [m for m in TARGETS if m in t])

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0
