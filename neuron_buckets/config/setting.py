"""A config field declares beside its default whether it shapes a compiled graph, and a section
checks its own values when it is built, from TOML or in code (as vLLM's config classes do).

``graph=True``: the value is part of what a compiled piece computes, so it enters the piece's
cache key (``compile/cache_key.py`` reads the declaration). ``graph=False``: it decides how or
where graphs are built, which buckets exist (each piece's own shape is in its key) or what a
runtime allocates, so changing it alone reuses every graph.

A field also declares who reads it, so a key that would do nothing is refused rather than
silently ignored: ``read_by`` the compile config (``COMPILE``: ``nb compile`` and the commands
that show or plan its grid; what a run needs of it the manifest records), a runtime file
(``RUN``: ``nb generate``/``nb serve --config``), or both; and ``tasks``, the ``model.task``
values it does something for (an embedding artifact has no decode steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, field, fields
from typing import Any, ClassVar, Protocol

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.utils.ascii_int import is_int

GRAPH, READ_BY, TASKS_KEY = "graph", "read_by", "tasks"  # the field metadata keys
COMPILE, RUN = "compile", "run"  # the two readers of a config: the compile config, a runtime file
TASKS = ("generate", "embed")  # model.task's values
DECODES = ("generate",)  # the tasks with decode steps: an embedding artifact only prefills


class Section(Protocol):
    """A config section: a dataclass named by its TOML table."""

    SECTION: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]


def setting(
    default: Any = MISSING,
    *,
    graph: bool,
    factory: Callable[[], Any] | None = None,
    read_by: tuple[str, ...] = (COMPILE,),
    tasks: tuple[str, ...] = TASKS,
) -> Any:
    """A section field: its default (or ``factory``), whether it enters a graph's cache key, who
    reads it and for which tasks it does anything."""
    metadata = {GRAPH: graph, READ_BY: read_by, TASKS_KEY: tasks}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def not_in_graph(section: type[Section]) -> frozenset[str]:
    """The fields of ``section`` that no compiled graph depends on."""
    return frozenset(f.name for f in fields(section) if not f.metadata[GRAPH])


def read_by(section: type[Section], reader: str) -> frozenset[str]:
    """The fields of ``section`` that ``reader`` (``COMPILE`` or ``RUN``) reads."""
    return frozenset(f.name for f in fields(section) if reader in f.metadata[READ_BY])


def for_task(section: type[Section], task: str) -> frozenset[str]:
    """The fields of ``section`` that do something for ``model.task = task``."""
    return frozenset(f.name for f in fields(section) if task in f.metadata[TASKS_KEY])


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
