"""Checkpoints in the compressed-tensors format (what llm-compressor writes and vLLM loads).

``scheme_of`` reads a ``quantization_config`` with compressed-tensors' own config classes and
turns it into the one ``QuantScheme`` nb computes, or refuses it with one line naming what it
does not handle: another ``quant_method``, a scheme other than 8-bit symmetric weights per channel
or per tensor (with int8 dynamic per-token activations, float8 static per-tensor ones, or none),
a target list that misses a decoder projection, or an ``ignore`` entry other than the LM head
(which nb keeps unquantized anyway). ``unpack`` turns a ``pack-quantized`` checkpoint's int32
words back into the int8 weights the other formats store as they are.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from neuron_buckets.model.quant.quant_scheme import QuantScheme

METHOD = "compressed-tensors"
# The modules of a decoder layer that the scheme must quantize, as transformers names them.
PROJECTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROBE_LAYER = "model.layers.0"
FORMATS = {
    "int": ("int-quantized", "pack-quantized", "naive-quantized"),
    "float": ("float-quantized", "naive-quantized"),
}
# (dynamic, strategy, type) of the input activations nb computes -> QuantScheme.activations
ACTIVATIONS = {(True, "token", "int"): "int8_token", (False, "tensor", "float"): "float8_tensor"}
UNPACKED = {"weight_packed": "weight"}  # pack-quantized names -> the name of what they unpack to


def scheme_of(raw: object) -> QuantScheme:
    """The ``QuantScheme`` of a config.json ``quantization_config``; ValueError says why not."""
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    if method != METHOD:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported; nb reads "
                         f"{METHOD!r} checkpoints")
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise ValueError(f"reading a {METHOD} checkpoint needs the compressed-tensors package: "
                         "pip install 'neuron-buckets[quantized]'") from None
    from pydantic import ValidationError

    try:
        config = QuantizationConfig.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"quantization_config is not a valid {METHOD} config: "
                         f"{e.errors()[0]['msg']} at {e.errors()[0]['loc']}") from None
    if extra := sorted(k for k in ("sparsity_config", "transform_config") if raw.get(k)):
        raise ValueError(f"quantization_config {', '.join(extra)} is not supported")
    if config.kv_cache_scheme is not None:
        raise ValueError("quantization_config kv_cache_scheme is not supported: the KV cache stays "
                         "in the model dtype")
    if config.quantization_status != "compressed":
        raise ValueError(f"quantization_status {_value(config.quantization_status)!r} is not supported; "
                         "nb reads compressed checkpoints")
    groups = list(config.config_groups.values())
    if len(groups) != 1:
        raise ValueError(f"quantization_config has {len(groups)} config_groups; nb reads one scheme "
                         "for every decoder projection")
    _check_targets(groups[0].targets, config.ignore or [])
    return _scheme(groups[0], config.format)


def _check_targets(targets: list[str], ignore: list[str]) -> None:
    """Every decoder projection quantized; nothing ignored but the LM head."""
    from compressed_tensors.utils.match import match_name

    def matched(name: str) -> bool:
        return any(t == "Linear" or match_name(name, t) for t in targets)

    if missed := [m for m in PROJECTION_MODULES if not matched(f"{PROBE_LAYER}.self_attn.{m}")
                  and not matched(f"{PROBE_LAYER}.mlp.{m}")]:
        raise ValueError(f"quantization_config targets {targets} leave {missed} unquantized; nb "
                         "needs one scheme for every decoder projection")
    if unhandled := [i for i in ignore if not match_name("lm_head", i)]:
        raise ValueError(f"quantization_config ignore entries {unhandled} are not supported; nb "
                         "leaves only the LM head unquantized")
    if not any(match_name("lm_head", i) for i in ignore) and any(t == "Linear" or match_name("lm_head", t)
                                                                  for t in targets):
        raise ValueError("quantization_config quantizes lm_head, which is not supported; add it to ignore")


def _value(x: Any) -> Any:
    """An enum field's value (the config classes keep some fields as their enums)."""
    return getattr(x, "value", x)


def _describe(args: Any) -> str:
    """One quantization argument set, as a user reads it: ``int8 group(128) dynamic``."""
    strategy = _value(args.strategy) or "none"
    if args.group_size:
        strategy += f"({args.group_size})"
    extras = [w for w, on in (("dynamic", args.dynamic), ("asymmetric", not args.symmetric)) if on]
    return " ".join([f"{_value(args.type)}{args.num_bits}", strategy, *extras])


def _scheme(group: Any, model_format: str | None) -> QuantScheme:
    w, a = group.weights, group.input_activations
    described = f"weights {_describe(w) if w else 'none'}, activations {_describe(a) if a else 'none'}"
    if group.output_activations is not None:
        described += f", outputs {_describe(group.output_activations)}"
    supported = "8-bit symmetric static weights per channel or per tensor, int8 with dynamic " \
                "per-token activations, float8 with static per-tensor activations, or none"
    weights_ok = (w is not None and w.num_bits == 8 and w.symmetric and not w.dynamic and not w.group_size
                  and _value(w.strategy) in ("channel", "tensor") and _value(w.type) in FORMATS)
    activations_ok = a is None or (a.num_bits == 8 and a.symmetric and not a.group_size and w is not None
                                   and (a.dynamic, _value(a.strategy), _value(a.type)) in ACTIVATIONS
                                   and _value(a.type) == _value(w.type))
    if not (weights_ok and activations_ok and group.output_activations is None):
        raise ValueError(f"quantization scheme ({described}) is not supported; nb reads {supported}")
    stored, kind = _value(group.format) or model_format, _value(w.type)
    if stored not in FORMATS[kind]:
        raise ValueError(f"compressed-tensors format {stored!r} is not supported for {_describe(w)} "
                         f"weights; use one of {FORMATS[kind]}")
    weights = "int8" if kind == "int" else "float8_e4m3fn"
    activations = "none" if a is None else ACTIVATIONS[a.dynamic, _value(a.strategy), _value(a.type)]
    return QuantScheme(weights, _value(w.strategy), activations)


def unpack(tensors: dict[str, Tensor]) -> None:
    """Unpack a ``pack-quantized`` state dict's 8-bit words in place (``weight_packed`` and its
    ``weight_shape`` -> an int8 ``weight``); other formats are left as they are."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        shape = tensors.pop(f"{module}.weight_shape", None)
        if shape is None:
            raise ValueError(f"{name} has no {module}.weight_shape to unpack it to")
        tensors[f"{module}.weight"] = unpack_from_int32(tensors.pop(name), 8, tuple(shape.tolist()))
