"""Quantize a float checkpoint directory into a compressed-tensors one, data-free.

What llm-compressor's data-free schemes write, made with compressed-tensors' own compressors: each
decoder projection's scale is its amax (per output channel or per tensor) over the stored type's
largest value, the compressor picks the storage format as llm-compressor would and writes the
quantized tensors, and ``config.json`` gets the ``quantization_config`` (the LM head ignored).
Static float8 activations need calibration: each projection's ``input_scale`` is the amax of its
input over one forward of random token ids, over float8's largest value (llm-compressor's min-max
observer, fed random ids for data). nb's tests and benchmarks make their quantized checkpoints so,
from random-weight models.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from neuron_buckets.model.checkpoint import read_state_dict
from neuron_buckets.model.checkpoint_names import LAYER_PARTS
from neuron_buckets.model.quant.quant_scheme import QuantScheme
from neuron_buckets.model.weights import PROJECTIONS

CALIBRATION_TOKENS = 64
QUANTIZED_SUFFIXES = tuple(f".{n.removesuffix('.weight')}" for f in PROJECTIONS for n in LAYER_PARTS[f])


def compressed_tensors_scheme(scheme: QuantScheme) -> object:
    """compressed-tensors' ``QuantizationScheme`` of nb's scheme, targeting every Linear."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    kind = "int" if scheme.weights == "int8" else "float"
    weights = QuantizationArgs(num_bits=8, type=kind, symmetric=True, strategy=scheme.strategy, dynamic=False)
    activations = None
    if scheme.activations == "int8_token":
        activations = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    elif scheme.static_input:
        activations = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor",
                                       dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)


def calibrated_input_amax(source: Path, tokens: int = CALIBRATION_TOKENS) -> dict[str, Tensor]:
    """Each Linear's largest |input| over a forward of the float model on ``tokens`` random token
    ids (seeded): what llm-compressor's min-max observer records from calibration data, without
    the data. transformers runs the float model (an oracle this project already trusts)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    amax: dict[str, Tensor] = {}

    def observe(name: str):
        def hook(_module: torch.nn.Module, inputs: tuple[Tensor, ...]) -> None:
            seen = inputs[0].detach().abs().amax()
            amax[name] = torch.maximum(amax[name], seen) if name in amax else seen
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(observe(name))
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    return amax


def quantize_checkpoint(source: Path, out: Path, scheme: QuantScheme) -> Path:
    """Write ``source`` (a float checkpoint directory) quantized by ``scheme`` into ``out``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig

    ct_scheme = compressed_tensors_scheme(scheme)
    fmt = infer_module_format(torch.nn.Linear, ct_scheme)
    compressor = BaseCompressor.get_value_from_registry(fmt.value)
    tensors, quantized = read_state_dict(source), {}
    inputs = calibrated_input_amax(source) if scheme.static_input else {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.endswith(QUANTIZED_SUFFIXES)):
            quantized[name] = tensor
            continue
        amax = tensor.float().abs().amax(1, keepdim=True) if scheme.strategy == "channel" else \
            tensor.float().abs().amax().reshape(1)
        scale = (amax.clamp(min=torch.finfo(torch.float32).tiny) / scheme.max_value).to(tensor.dtype)
        params = compressor.compress({"weight": tensor, "weight_scale": scale}, ct_scheme)
        quantized.update({f"{module}.{k}": v.contiguous() for k, v in params.items()})
        if scheme.static_input:  # the activations' scale maps their calibrated amax onto float8's largest
            amax = inputs[module].clamp(min=torch.finfo(torch.float32).tiny)
            quantized[f"{module}.input_scale"] = (amax / scheme.max_value).reshape(1).to(tensor.dtype)
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, out / f.name)
    save_file(quantized, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": ct_scheme}, format=fmt.value, quantization_status="compressed",
        ignore=["lm_head"],
    ).model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
