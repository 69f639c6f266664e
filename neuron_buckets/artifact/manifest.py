"""The artifact directory's ``manifest.json``: what was built, from what, and how to check it.

Read by the runtime, written by the compiler, validated against ``manifests/manifest.schema.json``
both ways. Writes are atomic (temp file, fsync, rename): a crash leaves the old manifest or the
new one, never half of either. All paths inside are relative, so a directory can be moved.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
GRAPHS = "graphs"


class ManifestError(ValueError):
    """A manifest that is missing, malformed, from a newer toolchain, or inconsistent with files."""


def schema() -> dict[str, Any]:
    text = resources.files("neuron_buckets.manifests").joinpath("manifest.schema.json").read_text()
    return json.loads(text)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Let ``write`` fill a temp file beside ``path``, fsync it, then rename it into place.

    A failure (a full disk) is an OSError naming ``path``, not the temp file, which is removed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        tmp_path.chmod(0o644)  # mkstemp makes 0600; artifacts are meant to be shared
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from e
    finally:
        tmp_path.unlink(missing_ok=True)


def validate(manifest: dict[str, Any], where: str = MANIFEST) -> dict[str, Any]:
    """Check the version first (a newer schema gets its own message), then the whole schema."""
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int):
        raise ManifestError(f"{where}: no integer schema_version; not an nb manifest")
    if version > SCHEMA_VERSION:
        raise ManifestError(
            f"{where}: schema_version {version} is newer than this toolchain supports "
            f"({SCHEMA_VERSION}); upgrade neuron-buckets"
        )
    try:
        jsonschema.validate(manifest, schema())
    except jsonschema.ValidationError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ManifestError(f"{where}: invalid at {at}: {e.message}") from None
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{directory} is not an artifact directory: {MANIFEST} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # truncated, or bytes damaged
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # a directory, unreadable
        raise ManifestError(f"{path}: cannot read it ({e.strerror or e})") from None
    return validate(data, str(path))


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    validate(manifest)
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    atomic_write(Path(directory) / MANIFEST, lambda p: p.write_text(text))
