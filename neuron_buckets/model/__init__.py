"""The model: a Llama-family decoder over the paged cache (``llama.py``, gpt-fast style), its
config (``model_config.py``), its fused weights (``weights.py``) and the projection they run
through (``linear.py``); the pieces a bucket compiles from it (``pieces.py``: embed, layer and its
fresh twin, head or an embedding artifact's norm). Weights come from a checkpoint directory
(``checkpoint.py``, by ``checkpoint_names.py``'s names), a GGUF file (``gguf_checkpoint.py``) or
none (``model_source.py`` tells which). Quantization (``quant/``) and tensor parallelism (``tp/``)
are transforms applied as the weights load, each in its folder; ``checkpoint_quantizer.py`` writes
a quantized checkpoint."""
