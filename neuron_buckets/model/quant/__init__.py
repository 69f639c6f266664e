"""Quantization, applied to a model as its weights are loaded: the schemes (``quant_scheme.py``),
a quantized weight and its scale (``quantized_weight.py``), the projection that reads one
(``quantized_linear.py``) and the compressed-tensors checkpoint format
(``compressed_tensors_format.py``). The transform that writes a quantized checkpoint reads and
writes checkpoints, so it lives beside their reader (``model/checkpoint_quantizer.py``)."""
