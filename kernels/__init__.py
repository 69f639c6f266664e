"""Block-KV kernels: NKI sources for Neuron and the torch golden references the model runs."""
