"""A config field declares beside its default whether it shapes a compiled graph, and a section
checks its own values when it is built, from TOML or in code (as vLLM's config classes do).

``graph=True``: the value is part of what a compiled piece computes, so it enters the piece's
cache key (``compile/cache_key.py`` reads the declaration). ``graph=False``: it decides how or
where graphs are built, which buckets exist (each piece's own shape is in its key) or what a
runtime allocates, so changing it alone reuses every graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, field, fields
from typing import Any, ClassVar, Protocol

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.utils.ascii_int import is_int

GRAPH = "graph"  # the field metadata key


class Section(Protocol):
    """A config section: a dataclass named by its TOML table."""

    SECTION: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]


def setting(default: Any = MISSING, *, graph: bool, factory: Callable[[], Any] | None = None) -> Any:
    """A section field: its default (or ``factory``) and whether it enters a graph's cache key."""
    if factory is not None:
        return field(default_factory=factory, metadata={GRAPH: graph})
    return field(default=default, metadata={GRAPH: graph})


def not_in_graph(section: type[Section]) -> frozenset[str]:
    """The fields of ``section`` that no compiled graph depends on."""
    return frozenset(f.name for f in fields(section) if not f.metadata[GRAPH])


def check_types(obj: Section) -> None:
    """Every value against its default's type: integers are non-negative, booleans booleans,
    strings strings, tables dicts. Fields without a typed default (None) check themselves."""
    for f in fields(obj):
        want = f.default_factory() if f.default is MISSING else f.default
        value, key = getattr(obj, f.name), f"{obj.SECTION}.{f.name}"
        if is_int(want) and (not is_int(value) or value < 0):
            raise ConfigError(f"{key} must be a non-negative integer, got {value!r}")
        if isinstance(want, bool) and not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        if isinstance(want, str) and not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        if isinstance(want, dict) and not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")


def check_positive(obj: Section, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{obj.SECTION}.{name} must be positive, got {getattr(obj, name)}")


def check_choice(obj: Section, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(obj, name) not in allowed:
        raise ConfigError(f"{obj.SECTION}.{name} must be one of {allowed}, got {getattr(obj, name)!r}")
