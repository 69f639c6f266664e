"""The transformers names of the checkpoint tensors each fused ``LayerWeights`` field is made of,
part by part: what loading fuses (``checkpoint.py``) and a rank's shard cuts (``tp/sharding.py``)."""

SCALE = "_scale"  # a quantized weight's scale: ``<module>.weight_scale``

# Each ``LayerWeights`` field -> the checkpoint tensors (names within ``model.layers.N.``) it
# stacks, in ``part_shapes`` order.
LAYER_PARTS = {
    "input_norm": ("input_layernorm.weight",),
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o": ("self_attn.o_proj.weight",),
    "post_norm": ("post_attention_layernorm.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "o_bias": ("self_attn.o_proj.bias",),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
}
