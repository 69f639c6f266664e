"""Manifest versions of one artifact directory: ``manifest.json`` and the re-plans beside it.

``nb compile`` writes ``manifest.json``, version 1. ``nb replan`` never rewrites it: each bucket
set it keeps is a new file, ``manifest.v2.json``, ``manifest.v3.json``..., naming the same
weights, tokenizer and kernel libraries and the graphs of ``graphs/`` (kept ones and new ones:
graph files are named by their content key, so no version overwrites another's). A server opens,
and on ``/admin/reload`` or SIGHUP moves to, the newest *complete* version: valid, every bucket
working, every graph file present, and compiled for the same model, cache geometry and weights as
``manifest.json`` (a version left over from before an ``nb compile`` of another geometry is
passed over, never served).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from neuron_buckets.artifact.manifest import (
    MANIFEST,
    Manifest,
    ManifestError,
    read_manifest,
    read_manifest_dict,
    validate,
)
from neuron_buckets.utils.files import atomic_write

VERSION_FILE = re.compile(r"manifest\.v([1-9][0-9]*)\.json")


def version_file(version: int) -> str:
    """The file name of manifest ``version`` (1 is ``manifest.json``)."""
    return MANIFEST if version == 1 else f"manifest.v{version}.json"


def manifest_versions(directory: Path) -> list[int]:
    """The versions present, ascending (1 always: without ``manifest.json`` there is no artifact)."""
    found = {int(m.group(1)) for p in Path(directory).iterdir() if (m := VERSION_FILE.fullmatch(p.name))}
    return [1, *sorted(v for v in found if v > 1)]


def read_version(directory: Path, version: int) -> Manifest:
    """Manifest ``version`` of ``directory``, typed and validated."""
    name = version_file(version)
    return Manifest.from_dict(read_manifest_dict(directory, name), str(Path(directory) / name))


def incomplete(directory: Path, manifest: Manifest, base: Manifest) -> str | None:
    """Why ``manifest`` cannot be served in place of ``base`` (``manifest.json``), or None."""
    if not manifest.buckets or any(b.status != "ok" for b in manifest.buckets):
        return "not every bucket compiled"
    if manifest.graph_facts() != base.graph_facts() or manifest.weights != base.weights:
        return "compiled for another model, geometry or weights than manifest.json"
    used = {key for b in manifest.buckets for key in b.pieces.values()}
    if missing := sorted(k for k in used if not (Path(directory) / manifest.pieces[k].file).is_file()):
        return f"graph file of piece {manifest.pieces[missing[0]].name} is missing"
    return None


def newest_complete(directory: Path) -> tuple[int, Manifest]:
    """The newest complete version and its manifest; ``manifest.json`` itself when no later one is
    (its own problems are raised, as ``read_manifest`` raises them)."""
    base = read_manifest(directory)
    for version in reversed(manifest_versions(directory)[1:]):
        try:
            manifest = read_version(directory, version)
        except ManifestError:
            continue
        if incomplete(directory, manifest, base) is None:
            return version, manifest
    return 1, base


def write_version(directory: Path, manifest: Manifest) -> int:
    """Write ``manifest`` as the next version (atomic; the caller holds the directory's lock, so
    no other writer picks the same number); its number."""
    version = manifest_versions(directory)[-1] + 1
    text = json.dumps(validate(manifest.to_dict()), indent=2, sort_keys=True) + "\n"
    atomic_write(Path(directory) / version_file(version), lambda p: p.write_text(text))
    return version

