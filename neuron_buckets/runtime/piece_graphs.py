"""An artifact's code: the piece graphs, each loaded on first use, and the native kernels they call.

Both are code this process runs, so each is loaded from a private copy checked against the
manifest's sha256 (``verified_copy``), and only for the versions the graphs were compiled with.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neuron_buckets.artifact.manifest import Manifest, ManifestError
from neuron_buckets.backends import Backend, GraphFn
from neuron_buckets.kernels.libraries import LIBRARIES
from neuron_buckets.runtime.artifact_check import ArtifactError, verified_copy
from neuron_buckets.utils.files import DigestMismatch


@contextmanager
def _checked_copy(path: Path, sha256: str, what: str, named: str) -> Iterator[Path]:
    """``verified_copy`` of an artifact file that nb loads as code (a graph, a kernel library),
    refused as an ``ArtifactError`` when missing (``what``) or changed (``named``)."""
    if not path.is_file():
        raise ArtifactError(f"{what} is missing: {path}")
    try:
        with verified_copy(path, sha256, what) as copy:
            yield copy
    except DigestMismatch:
        raise ArtifactError(f"{named} does not match its sha256 (corrupt or tampered)") from None


class PieceGraphs:
    """The graphs of a manifest's pieces by key, loaded as they are first asked for."""

    def __init__(self, directory: Path, manifest: Manifest, backend: Backend, device: str) -> None:
        self.directory, self.manifest, self.backend, self.device = directory, manifest, backend, device
        self._check_versions()
        self._register_libraries()
        self._graphs: dict[str, GraphFn] = {}

    def _check_versions(self) -> None:
        recorded = self.manifest.backend.versions
        current = self.backend.load_versions()
        if diff := {k: (recorded.get(k), v) for k, v in current.items() if recorded.get(k) != v}:
            detail = ", ".join(f"{k}: built with {a}, running {b}" for k, (a, b) in diff.items())
            raise ManifestError(
                f"{self.directory}: graphs were compiled for other versions ({detail}); recompile"
            )

    def _register_libraries(self) -> None:
        """Register the native kernels the graphs call (a graph finds its kernel by name)."""
        for name, lib in self.manifest.libraries.items():
            path = self.directory / lib.file
            if name not in LIBRARIES:
                raise ArtifactError(f"{self.directory}: unknown kernel library {name!r}; recompile")
            with _checked_copy(path, lib.sha256, f"kernel library {name}", f"kernel library {path}") as copy:
                LIBRARIES[name].register(copy)

    def graph(self, key: str) -> GraphFn:
        """A piece's graph, loaded on first use after checking its file against the manifest."""
        if key in self._graphs:
            return self._graphs[key]
        rec = self.manifest.pieces[key]
        path = self.directory / rec.file
        what = f"graph of piece {rec.name}"
        with _checked_copy(path, rec.sha256, what, f"graph {path} of piece {rec.name}") as copy:
            fn = self.backend.load(copy, self.manifest.model.config, self.device)
        self._graphs[key] = fn
        return fn

    @property
    def loaded(self) -> list[str]:
        """Keys of the piece graphs loaded so far."""
        return list(self._graphs)

    def use_manifest(self, manifest: Manifest) -> None:
        """Load ``manifest``'s pieces from now on, keeping the graphs loaded so far that it uses
        (a graph is named by its content, so another version's same key is the same graph)."""
        used = {key for r in manifest.buckets if r.status == "ok" for key in r.pieces.values()}
        self.manifest = manifest
        self._graphs = {k: fn for k, fn in self._graphs.items() if k in used}
