"""neuron-buckets: compile one fixed-shape LLM graph per (batch, seq) bucket over a block-KV cache."""

__version__ = "0.1.0"
