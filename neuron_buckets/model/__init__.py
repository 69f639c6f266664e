"""The model: a Llama-family decoder over the paged cache (``llama.py``, gpt-fast style) and the
pieces a bucket compiles from it (``pieces.py``: embed, layer, head or norm); its config
(``model_config.py``); its weights (``weights.py``), read from checkpoint directories
(``checkpoint.py``, compressed-tensors included); quantized projections (``quant_scheme.py`` and
its kin) and tensor parallelism (``tensor_parallel.py``, ``sharding.py``)."""
