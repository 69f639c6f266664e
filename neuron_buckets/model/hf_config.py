"""A Hugging Face ``config.json`` dict checked before ``LlamaConfig.from_hf`` reads it.

The dict comes from a user's checkpoint or from a manifest someone may have edited, so a list,
a missing key or ``"vocab_size": "256"`` must fail with one message naming where the dict came
from and the key, not as a KeyError, or a TypeError deep in tensor allocation.
"""

from __future__ import annotations

from neuron_buckets.model.llama import LlamaConfig

REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
# null or absent: derived from the others, or (sliding_window) no window
OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "sliding_window")
OPTIONAL_NUMBERS = ("rms_norm_eps", "rope_theta")


class ModelConfigError(ValueError):
    """A model config that cannot describe a supported model; the message names its source."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_hf_config(raw: object, where: str) -> LlamaConfig:
    """``raw`` as a LlamaConfig, or a ModelConfigError naming ``where`` and the bad key."""
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where}: expected a JSON object of settings, got a {type(raw).__name__}")
    if missing := [k for k in REQUIRED_INTS if k not in raw]:
        raise ModelConfigError(f"{where}: lacks {', '.join(map(repr, missing))}")
    for key in REQUIRED_INTS + OPTIONAL_INTS:
        value = raw.get(key)
        if (key in REQUIRED_INTS or value is not None) and not (_is_int(value) and value > 0):
            raise ModelConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    for key in OPTIONAL_NUMBERS:
        value = raw.get(key, 1.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ModelConfigError(f"{where}: {key} must be a positive number, got {value!r}")
    for key in ("tie_word_embeddings", "attention_bias"):
        if not isinstance(raw.get(key, False), bool):
            raise ModelConfigError(f"{where}: {key} must be true or false")
    try:
        return LlamaConfig.from_hf(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelConfigError(f"{where}: {e}") from None
