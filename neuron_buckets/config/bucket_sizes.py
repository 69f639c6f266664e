"""A bucket list as a config gives it: explicit sizes, or a strategy table, checked by the
vLLM-neuron rules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.core.bucket import linear, powers_of_two, validate_buckets
from neuron_buckets.utils.ascii_int import is_int

STRATEGY_KEYS = ("max", "min", "step", "strategy")


def bucket_sizes(key: str, spec: Any, last: int, last_key: str) -> tuple[int, ...]:
    """Explicit ints, or ``{strategy = powers_of_two | linear, min, max, step}`` (min 1, max
    ``last``, step min), as ascending sizes that end at ``last``, the setting ``last_key``."""
    if isinstance(spec, Mapping):
        spec = _expand(key, spec, last)
    elif isinstance(spec, str) or not isinstance(spec, Sequence):
        raise ConfigError(f"{key}: expected a list of ints or a strategy table, got {spec!r}")
    try:
        return validate_buckets(key, spec, last, last_key)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _expand(key: str, spec: Mapping[str, Any], last: int) -> list[int]:
    if unknown := set(spec) - set(STRATEGY_KEYS):
        raise ConfigError(f"{key}: unknown key(s) {sorted(unknown)}; allowed: {list(STRATEGY_KEYS)}")
    lo, hi = spec.get("min", 1), spec.get("max", last)
    step = spec.get("step", lo)
    for name, value in (("min", lo), ("max", hi), ("step", step)):
        if not is_int(value):
            raise ConfigError(f"{key}.{name} must be an integer, got {value!r}")
    try:
        if spec.get("strategy") == "powers_of_two":
            return powers_of_two(lo, hi)
        if spec.get("strategy") == "linear":
            return linear(lo, hi, step)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from e
    raise ConfigError(f"{key}.strategy must be 'powers_of_two' or 'linear', got {spec.get('strategy')!r}")
