"""The model config: ``LlamaConfig``, read from a Hugging Face ``config.json`` and checked first.

Llama, Mistral, Qwen2/2.5 and Qwen3 are one decoder with a few switches (``ARCHITECTURES``):
biases on the attention projections, RMSNorm on each head of q and k, and a sliding attention
window; a compressed-tensors ``quantization_config`` becomes the projections' ``QuantScheme``.
The ``config.json`` dict comes from a user's checkpoint or from a manifest someone may have
edited, so ``parse_hf_config`` makes a list, a missing key or ``"vocab_size": "256"`` fail with one
message naming where the dict came from and the key, not as a KeyError, or a TypeError deep in
tensor allocation; a setting that would change the math and is not modelled is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_buckets.model.quant.quant_scheme import QuantScheme
from neuron_buckets.utils.ascii_int import is_int

ROPE_TYPES = ("default", "llama3")
# model_type -> the transformers class whose math ``model/llama.py`` reproduces (tests check each
# one), and what that architecture adds to the Llama decoder.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # attention_bias: biases on q, k, v and o
    "mistral": "MistralForCausalLM",  # sliding_window: every layer sees the last W positions only
    "qwen2": "Qwen2ForCausalLM",  # biases on q, k and v, always (Qwen2 and Qwen2.5)
    "qwen3": "Qwen3ForCausalLM",  # RMSNorm over each head of q and k before RoPE; attention_bias
}
# config.json entries that would change the math; any value but the listed one is refused. Keys an
# architecture's transformers class never reads (Qwen2's attention_bias) are not looked at.
_UNSUPPORTED = {"hidden_act": "silu"}
_UNSUPPORTED_BY_TYPE: dict[str, dict[str, object]] = {
    "llama": {"mlp_bias": False, "sliding_window": None, "use_sliding_window": False},
    "mistral": {},
    # Qwen slides only the layers from max_window_layers on, and one compiled layer serves them all.
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False},
}
# Values transformers' config classes assume when config.json leaves a key out.
_DEFAULTS: dict[str, dict[str, object]] = {"mistral": {"sliding_window": 4096}, "qwen3": {"head_dim": 128}}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent rotary scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    """The shape and switches of one decoder; checks itself, so no impossible model is built."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    model_type: str = "llama"  # a key of ARCHITECTURES
    attention_bias: bool = False  # llama, qwen3: biases on q, k, v and o
    sliding_window: int | None = None  # mistral: a token sees the W positions ending at its own
    quantization: QuantScheme | None = None  # the decoder projections' weights, if quantized

    def __post_init__(self) -> None:
        check_model_type(self.model_type)
        if self.attention_bias and self.model_type not in ("llama", "qwen3"):
            raise ValueError(f"attention_bias is a llama or qwen3 setting, not {self.model_type}'s")
        if self.sliding_window is not None and (self.model_type != "mistral" or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window} needs model_type mistral and W >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """Read a transformers ``config.json`` dict of an ``ARCHITECTURES`` model, old or new rope
        keys alike; any setting that would change the math and is not modelled here is refused."""
        model_type = check_model_type(hf.get("model_type", "llama"))
        hf = {**_DEFAULTS.get(model_type, {}), **hf}
        for key, allowed in {**_UNSUPPORTED, **_UNSUPPORTED_BY_TYPE[model_type]}.items():
            if hf.get(key, allowed) != allowed:
                raise ValueError(f"config field {key}={hf[key]!r} is not supported (need {allowed!r})")
        if model_type != "mistral" and set(hf.get("layer_types") or ()) - {"full_attention"}:
            raise ValueError(f"config field layer_types={hf['layer_types']!r} is not supported "
                             "(every layer must be full_attention)")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; use one of {ROPE_TYPES}")
        if rope.pop("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported")
        scaling = None
        if rope_type == "llama3":
            try:
                scaling = RopeScaling(**rope)
            except TypeError as e:
                raise ValueError(f"llama3 rope scaling {rope} is invalid: {e}") from None
        heads = hf["num_attention_heads"]
        return cls(
            quantization=_quantization(hf),
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            model_type=model_type,
            attention_bias=model_type in ("llama", "qwen3") and hf.get("attention_bias", False),
            sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
        )

    def to_hf(self) -> dict:
        """The ``config.json`` dict (newer ``rope_parameters`` form) that ``from_hf`` reads back, and
        that the architecture's transformers config class reads as the same model."""
        rope: dict = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**rope, **vars(self.rope_scaling), "rope_type": "llama3"}
        own = {
            "llama": {"attention_bias": self.attention_bias},
            "mistral": {"sliding_window": self.sliding_window},
            "qwen3": {"attention_bias": self.attention_bias},
        }
        return {
            "model_type": self.model_type,
            "architectures": [ARCHITECTURES[self.model_type]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            **own.get(self.model_type, {}),
            **({"quantization": self.quantization.to_dict()} if self.quantization else {}),
        }


def _quantization(hf: dict) -> QuantScheme | None:
    """The scheme of a checkpoint's ``quantization_config`` (read through compressed-tensors,
    imported only then: it takes seconds) or of nb's own ``quantization`` (``to_hf``)."""
    if "quantization" in hf:
        return QuantScheme.of(hf["quantization"])
    if hf.get("quantization_config") is None:
        return None
    from neuron_buckets.model.quant.compressed_tensors_format import scheme_of

    return scheme_of(hf["quantization_config"])


def check_model_type(model_type: str) -> str:
    """The config's model_type if the model reproduces it; named first, before any other field."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; use one of {sorted(ARCHITECTURES)}")
    return model_type


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


def parse_hf_config(raw: object, where: str) -> LlamaConfig:
    """``raw`` as a LlamaConfig, or a ModelConfigError naming ``where`` and the bad key."""
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where}: expected a JSON object of settings, got a {type(raw).__name__}")
    if missing := [k for k in REQUIRED_INTS if k not in raw]:
        raise ModelConfigError(f"{where}: lacks {', '.join(map(repr, missing))}")
    for key in REQUIRED_INTS + OPTIONAL_INTS:
        value = raw.get(key)
        if (key in REQUIRED_INTS or value is not None) and not (is_int(value) and value > 0):
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
