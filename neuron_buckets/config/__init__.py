"""The TOML config, one module per section (as vLLM's config package). Each section checks its
own values and declares beside each field whether it shapes a graph (``setting``); ``config``
joins the sections, ``loader`` reads TOML into them, and ``grid`` turns a config into the buckets
``nb compile`` builds."""

from neuron_buckets.config.buckets import BucketConfig
from neuron_buckets.config.cache import DTYPES, CacheConfig
from neuron_buckets.config.compile import BACKENDS, EXECUTORS, CompileConfig
from neuron_buckets.config.config import Config
from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.grid import enumerate_grid
from neuron_buckets.config.loader import load_config, parse_config
from neuron_buckets.config.lora import LoraConfig
from neuron_buckets.config.model import ModelSource
from neuron_buckets.config.parallel import ParallelConfig
from neuron_buckets.config.speculative import SpeculativeConfig

__all__ = [
    "BACKENDS",
    "DTYPES",
    "EXECUTORS",
    "BucketConfig",
    "CacheConfig",
    "CompileConfig",
    "Config",
    "ConfigError",
    "LoraConfig",
    "ModelSource",
    "ParallelConfig",
    "SpeculativeConfig",
    "enumerate_grid",
    "load_config",
    "parse_config",
]
