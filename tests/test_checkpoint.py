"""Configs and weights as real checkpoints write them, and the embedded default model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from neuron_buckets.core.bucket import Bucket
from neuron_buckets.core.padding import pad_prefill
from neuron_buckets.model.checkpoint import (
    DEFAULT_CONFIG,
    checkpoint_shapes,
    checkpoint_tensors,
    default_model,
    load_model,
    load_weights,
    read_state_dict,
    save_weights,
)
from neuron_buckets.model.llama import Llama
from neuron_buckets.model.model_config import LlamaConfig, RopeScaling
from neuron_buckets.model.weights import LayerWeights, layer_shapes
from tests.conftest import segment

BASE = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def last_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    """Our logits for the last of ``ids``, prefilled in one padded step over blocks 3, 1, 2."""
    k = torch.zeros(model.cache_shape(8, 16), dtype=model.weights.embed.dtype)
    step = pad_prefill([segment(ids, 0, [3, 1, 2])], Bucket("prefill", 1, 48, 48), 16)
    with torch.no_grad():
        return model(*step.args(), k, k.clone())[0]


@pytest.mark.parametrize("rope", [
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},
    {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}},
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}},
])
def test_old_and_new_rope_keys_read_alike(rope):
    config = LlamaConfig.from_hf({**BASE, **rope})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert config.head_dim == 16 and config.num_kv_heads == 2
    assert LlamaConfig.from_hf(config.to_hf()) == config


def test_default_rope_without_scaling():
    old = LlamaConfig.from_hf({**BASE, "rope_theta": 1e4, "rope_scaling": None})
    new = LlamaConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 1e4}})
    assert old == new and old.rope_scaling is None


@pytest.mark.parametrize("field, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported; use one of"),
    ({"model_type": "gemma", "hidden_act": "gelu"}, "model_type 'gemma'"),  # the type is named first
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=True"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"model_type": "mistral", "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
])
def test_unsupported_config_fields_are_refused(field, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf({**BASE, **field})


@pytest.mark.parametrize("hf, flags", [
    ({}, (False, False, False, None)),
    ({"attention_bias": True}, (True, True, False, None)),
    ({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False},
     (True, False, False, None)),  # Qwen2.5 checkpoints: a window that is not used
    ({"model_type": "qwen2", "attention_bias": True}, (True, False, False, None)),  # Qwen2 never reads it
    ({"model_type": "qwen3", "layer_types": ["full_attention"] * 2}, (False, False, True, None)),
    ({"model_type": "qwen3", "attention_bias": True}, (True, True, True, None)),
    ({"model_type": "mistral", "sliding_window": 12}, (False, False, False, 12)),
    ({"model_type": "mistral", "sliding_window": None}, (False, False, False, None)),
    ({"model_type": "mistral"}, (False, False, False, 4096)),  # MistralConfig's default
])
def test_architecture_switches_read_as_transformers_reads_them(hf, flags):
    """Each config gives the biases, q/k norms and window its transformers class builds, and
    ``to_hf`` writes a config that reads back the same."""
    config = LlamaConfig.from_hf({**BASE, **hf})
    assert (config.qkv_bias, config.o_bias, config.qk_norm, config.sliding_window) == flags
    assert LlamaConfig.from_hf(config.to_hf()) == config
    names = checkpoint_shapes(config)
    has = ("self_attn.q_proj.bias", "self_attn.o_proj.bias", "self_attn.q_norm.weight")
    assert tuple(f"model.layers.0.{n}" in names for n in has) == flags[:3]


def test_qwen3_without_head_dim_has_transformers_default_of_128():
    assert LlamaConfig.from_hf({**BASE, "model_type": "qwen3"}).head_dim == 128


@pytest.mark.parametrize("dtype, shard", [
    (torch.bfloat16, "60KB"), (torch.float16, None), (torch.float32, "100KB"),
])
def test_tied_checkpoint_directory_loads_as_transformers_runs_it(tmp_path, dtype, shard):
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**BASE, tie_word_embeddings=True, initializer_range=0.15)
    hf = transformers.LlamaForCausalLM(hf_config).to(dtype).eval()
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    sharded = (tmp_path / "model.safetensors.index.json").is_file()
    assert sharded == (shard is not None)
    if sharded:
        shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())
                     ["weight_map"].values())
        assert len(shards) > 1
    model = load_model(tmp_path)  # float32, from the stored dtype
    assert model.weights.lm_head is None and model.config.tie_word_embeddings
    ids = torch.randint(0, 256, (37,)).tolist()
    # Reload rather than hf.float(): .to(dtype) also rounded transformers' rotary buffer.
    ref_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model.eval()(torch.tensor([ids])).logits[0, -1]
    got = last_logits(model, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert int(got.argmax()) == int(ref.argmax())


def test_missing_or_misshapen_weights_are_named(tmp_path):
    config = LlamaConfig.from_hf(BASE)
    full = {name: torch.zeros(shape) for name, shape in checkpoint_shapes(config).items()}
    weights = dict(full)
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        load_weights(config, weights)
    weights = {**full, "lm_head.weight": torch.zeros(255, 64)}
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(255, 64\)"):
        load_weights(config, weights)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        read_state_dict(tmp_path)


def test_default_model_is_deterministic_with_lively_logits():
    a, b = default_model(), default_model()
    assert all(torch.equal(x, y) for x, y in zip(a.weights.tensors(), b.weights.tensors(), strict=True))
    logits = last_logits(a, list(range(1, 30)))
    assert logits.std() > 0.5  # clearly separated: greedy decoding is not a coin toss


def test_weights_round_trip_through_one_file_and_into_transformers(tmp_path):
    """The artifact's weights.safetensors holds transformers names: HF loads it as is."""
    model = default_model()
    save_weights(model, tmp_path / "weights.safetensors")
    again = Llama(DEFAULT_CONFIG, load_weights(DEFAULT_CONFIG, tmp_path / "weights.safetensors"))
    ids = [5, 9, 200, 3, 77]
    assert torch.equal(last_logits(again, ids), last_logits(model, ids))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DEFAULT_CONFIG.to_hf())).eval()
    hf.load_state_dict(checkpoint_tensors(model.config, model.weights), strict=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(last_logits(model, ids), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hf", [
    {"model_type": "llama"},
    {"model_type": "llama", "attention_bias": True, "tie_word_embeddings": True},
    {"model_type": "qwen2"},
    {"model_type": "qwen3", "head_dim": 16, "attention_bias": True},
    {"model_type": "mistral", "sliding_window": 8},
])
def test_weights_fuse_once_at_load_and_split_back_to_the_checkpoint_names(hf):
    """Every architecture's biases and norms land in their LayerWeights field (q/k/v and gate/up
    stacked in order), a layer piece's flat inputs rebuild the same record, and saving gives back
    exactly the checkpoint's tensors by their transformers names."""
    config = LlamaConfig.from_hf({**BASE, **hf})
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen) for n, s in checkpoint_shapes(config).items()}
    weights = load_weights(config, dict(tensors))
    layer = weights.layers[1]
    prefix = "model.layers.1."
    want_qkv = [tensors[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(layer.qkv, torch.cat(want_qkv))
    assert torch.equal(layer.gate_up, torch.cat([tensors[prefix + "mlp.gate_proj.weight"],
                                                 tensors[prefix + "mlp.up_proj.weight"]]))
    assert (layer.qkv_bias is not None, layer.o_bias is not None, layer.q_norm is not None) == (
        config.qkv_bias, config.o_bias, config.qk_norm)
    assert LayerWeights.of(config, layer.tensors()) == layer
    assert [tuple(t.shape) for t in layer.tensors()] == layer_shapes(config)
    back = checkpoint_tensors(config, weights)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    assert (weights.lm_head is None) == config.tie_word_embeddings
    assert weights.head[1] is (weights.embed if config.tie_word_embeddings else weights.lm_head)


@pytest.mark.parametrize(
    "shard", ["../../x.safetensors", "/etc/passwd", "sub/../../y.safetensors", "link.safetensors"]
)
def test_an_index_naming_a_shard_outside_the_model_directory_is_refused(tmp_path, shard):
    """Probe 12: the index's shard names were joined to the directory unchecked."""
    from neuron_buckets.model.checkpoint import CheckpointError, shard_files

    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "x.safetensors").write_bytes(b"")
    (model / "link.safetensors").symlink_to(tmp_path / "x.safetensors")
    index = {"weight_map": {"a": "model-00001.safetensors", "b": shard}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"shard '{shard}' is not a file name inside"):
        shard_files(model)
    index["weight_map"]["b"] = "model-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in shard_files(model)] == ["model-00001.safetensors", "model-00002.safetensors"]
