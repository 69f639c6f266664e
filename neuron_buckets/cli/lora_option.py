"""The ``NAME=PATH`` adapters of ``nb generate --lora`` and ``nb serve --lora-modules`` (vLLM's form)."""

from __future__ import annotations

from pathlib import Path

from neuron_buckets.utils.errors import UserError


def lora_modules(option: str, items: list[str] | None) -> dict[str, Path]:
    """Each ``NAME=PATH`` as name -> PEFT directory; one line for a malformed or repeated name."""
    found: dict[str, Path] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"{option} {item!r}: expected NAME=PATH (a PEFT LoRA adapter's directory)")
        if name in found:
            raise UserError(f"{option}: adapter name {name!r} is given twice")
        found[name] = Path(path)
    return found
