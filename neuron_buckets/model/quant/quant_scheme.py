"""``QuantScheme``: how a quantized checkpoint's decoder projections are stored and computed.

Every projection of every layer shares the one scheme (one compiled layer piece serves all
layers), the embedding, norms and LM head stay in the model dtype. The scheme enters the model
config (``LlamaConfig.quantization``), so it is part of every graph key and of the manifest; nb
writes it in its own short form (``to_dict``), which reading back needs no compressed-tensors
import. What a checkpoint's ``quantization_config`` says is ``model/quant/compressed_tensors_format.py``'s
business.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

# The stored weights' torch dtype names, each with its largest magnitude (what a scale maps a
# channel's or tensor's amax onto).
WEIGHTS = {"int8": 127.0, "float8_e4m3fn": 448.0}
STRATEGIES = ("channel", "tensor")
ACTIVATIONS = ("none", "int8_token", "float8_tensor")


@dataclass(frozen=True)
class QuantScheme:
    """The projections' weights (``weights``, with one scale per ``strategy``) and whether the
    activations are quantized too (``int8_token``: to int8 per token, dynamically, each step;
    ``float8_tensor``: to float8 by each projection's stored input scale, static)."""

    weights: Literal["int8", "float8_e4m3fn"]
    strategy: Literal["channel", "tensor"]
    activations: Literal["none", "int8_token", "float8_tensor"] = "none"

    def __post_init__(self) -> None:
        choices = {"weights": tuple(WEIGHTS), "strategy": STRATEGIES, "activations": ACTIVATIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"quantization {name}={getattr(self, name)!r} is not one of {allowed}")
        if self.activations == "int8_token" and self.weights != "int8":
            raise ValueError("int8_token activations need int8 weights")
        if self.activations == "float8_tensor" and self.weights != "float8_e4m3fn":
            raise ValueError("float8_tensor activations need float8_e4m3fn weights")

    @property
    def static_input(self) -> bool:
        """Whether each projection has a stored input scale (a third graph input after its scale)."""
        return self.activations == "float8_tensor"

    @property
    def name(self) -> str:
        """Short label, as vLLM names schemes (``w8a16-int8-channel``)."""
        a = "a8" if self.activations != "none" else "a16"
        return f"w8{a}-{'fp8' if self.weights == 'float8_e4m3fn' else 'int8'}-{self.strategy}"

    @property
    def max_value(self) -> float:
        return WEIGHTS[self.weights]

    def runtime_bytes(self, model_bytes: int) -> int:
        """Bytes per projection weight that a runtime holds (``quantized_weight.runtime_dtype``)."""
        return 1 if self.weights == "int8" else model_bytes

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def of(cls, raw: object) -> QuantScheme:
        """``to_dict`` back; a ValueError names what is wrong."""
        if not isinstance(raw, dict) or set(raw) - {"weights", "strategy", "activations"}:
            raise ValueError(f"quantization must be an object of weights, strategy, activations, got {raw!r}")
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"quantization {raw!r}: {e}") from None
