"""A PEFT LoRA adapter read for an artifact's slots: checked against them, padded and scaled.

PEFT stores ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``) beside
``adapter_model.safetensors`` (``...layers.{i}.<module>.<proj>.lora_A.weight`` (r, in) and
``lora_B.weight`` (out, r)). Each projection becomes the slot layout ``model/lora.py`` takes,
``A`` (in, max_rank) and ``B`` (max_rank, out) with PEFT's scaling folded into B and the rank padded
with zeros, so a slot's product equals PEFT's. An adapter is named by the sha256 of both files:
the same bytes under two names are one adapter, and its name salts the prefix cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from neuron_buckets.model.lora import LoraShape, projection_dims
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.utils.errors import UserError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(UserError, ValueError):
    """An adapter this artifact cannot serve: one line saying why."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter in slot layout: per layer, (A, B) of each target it has (others stay zero)."""

    name: str
    digest: str  # sha256 of its config and weights: what it is, whatever its name
    layers: tuple[dict[str, tuple[Tensor, Tensor]], ...]


def read_adapter(
    name: str, path: Path, config: LlamaConfig, shape: LoraShape, dtype: torch.dtype
) -> LoraAdapter:
    """Read and check a PEFT adapter directory for slots of ``shape``; ``AdapterError`` otherwise."""
    path = Path(path)
    files = [path / CONFIG, path / WEIGHTS]
    if missing := [f.name for f in files if not f.is_file()]:
        raise AdapterError(f"adapter {name!r}: {path} has no {missing[0]} (a PEFT LoRA directory)")
    try:
        peft = json.loads(files[0].read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {files[0]}: {e}") from None
    rank, scale = _rank_and_scale(name, peft, shape)
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    dims = projection_dims(config)
    layers: list[dict[str, tuple[Tensor, Tensor]]] = [{} for _ in range(config.num_layers)]
    halves: dict[tuple[int, str, str], Tensor] = {}
    with safe_open(files[1], "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            if (m := KEY.search(key)) is None:
                raise AdapterError(f"adapter {name!r}: tensor {key} is no LoRA A or B of a layer projection")
            layer, target, half = int(m[1]), m[2], m[3]
            if target not in shape.targets:
                raise AdapterError(f"adapter {name!r}: targets {target}, which this artifact's slots lack "
                                   f"(lora.target_modules = {list(shape.targets)})")
            if layer >= config.num_layers:
                raise AdapterError(f"adapter {name!r}: layer {layer} is beyond the model's "
                                   f"{config.num_layers}")
            halves[layer, target, half] = f.get_tensor(key)
    for (layer, target, half), t in sorted(halves.items()):
        if half == "B":
            continue
        b = halves.get((layer, target, "B"))
        n_in, n_out = dims[target]
        if b is None or t.shape != (rank, n_in) or b.shape != (n_out, rank):
            got = (tuple(t.shape), None if b is None else tuple(b.shape))
            raise AdapterError(f"adapter {name!r}: layer {layer} {target} has A, B of shapes {got}, "
                               f"the model needs {(rank, n_in)} and {(n_out, rank)}")
        if not (t.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"adapter {name!r}: layer {layer} {target} is {t.dtype}, not floating point")
        a_slot = torch.zeros(n_in, shape.max_rank, dtype=dtype)
        b_slot = torch.zeros(shape.max_rank, n_out, dtype=dtype)
        a_slot[:, :rank] = t.T.to(dtype)
        b_slot[:rank] = (b.T.double() * scale).to(dtype)
        layers[layer][target] = (a_slot, b_slot)
    return LoraAdapter(name, digest, tuple(layers))


def _rank_and_scale(name: str, peft: dict, shape: LoraShape) -> tuple[int, float]:
    """The adapter's rank and PEFT's scaling of its product (``lora_alpha / r``, rsLoRA's
    ``/ sqrt(r)``), refusing what the slots cannot hold."""
    rank, alpha = peft.get("r"), peft.get("lora_alpha", peft.get("r"))
    if peft.get("peft_type", "LORA") != "LORA" or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"adapter {name!r}: not a PEFT LoRA adapter (peft_type LORA with a positive r)")
    if rank > shape.max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} is above the artifact's lora.max_lora_rank "
                           f"{shape.max_rank}")
    if peft.get("rank_pattern") or peft.get("alpha_pattern") or peft.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: per-module ranks, alphas and LoRA biases are not supported")
    return rank, alpha / (math.sqrt(rank) if peft.get("use_rslora") else rank)
