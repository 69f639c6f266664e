"""Every backend fits the protocol's promises that the manifest relies on, SDK or not."""

from __future__ import annotations

import pytest

from neuron_buckets.artifact.manifest import schema
from neuron_buckets.backends import BACKEND_NAMES, get_backend


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_versions_carry_what_the_manifest_schema_requires(name):
    required = schema()["properties"]["backend"]["properties"]["versions"]["required"]
    versions = get_backend(name).versions()
    assert set(required) <= set(versions)
    assert all(isinstance(v, str) and v for v in versions.values())


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_available_says_why(name):
    ok, why = get_backend(name).available()
    # Usable: the versions it will run with. Not usable: what to install.
    assert ("torch " in why) if ok else ("pip install" in why or "compiler" in why), why


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="inductor"):
        get_backend("tvm")


def test_inductor_graphs_are_keyed_and_checked_by_the_cpu_isa(monkeypatch):
    """An AVX-512 graph must never be reused on an AVX2-only machine: the ISA is in the versions
    that enter every key and that the runtime checks at open."""
    import torch

    from neuron_buckets.backends.inductor import InductorBackend

    seen = {}
    for isa in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda isa=isa: isa)
        seen[isa] = InductorBackend().load_versions()
    assert seen["AVX2"]["cpu_isa"] == "AVX2" and seen["AVX512"]["cpu_isa"] == "AVX512"
