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


@pytest.mark.parametrize(("module", "probe", "key", "ours"), [
    ("int8_linear_cpu", "cpu_has_vnni", "int8_w8a8", "nb avx512_vnni"),
    ("bf16_linear_cpu", "chosen_here", "bf16", "nb avx512_bf16"),
])
def test_inductor_graphs_are_keyed_by_the_projection_kernel_the_cpu_runs(monkeypatch, module, probe, key,
                                                                          ours):
    """A W8A8 (bfloat16) graph traced for nb's AVX512-VNNI (AVX512-BF16) kernel reads weights packed
    for it, a oneDNN one oneDNN's layout: a cache shared with a CPU of the other kind must not hand
    one to the other."""
    import importlib

    from neuron_buckets.backends import inductor
    from neuron_buckets.backends.inductor import InductorBackend

    kernel = importlib.import_module(f"neuron_buckets.kernels.{module}")
    monkeypatch.setattr(inductor, "onednn_int8_exact", lambda: True)  # oneDNN's INT8 path: VNNI
    seen = {}
    for has in (False, True):
        monkeypatch.setattr(kernel, probe, lambda has=has: has)
        seen[has] = InductorBackend().load_versions()[key]
    assert seen == {False: "onednn", True: ours}


def test_w8a8_graphs_on_a_cpu_without_vnni_are_keyed_apart_from_onednns(monkeypatch):
    """Without any VNNI a W8A8 graph multiplies in float32 over dense weights, not oneDNN's packed
    ones (``model/quantized_linear.py``): its key says so."""
    from neuron_buckets.backends import inductor
    from neuron_buckets.kernels import int8_linear_cpu

    monkeypatch.setattr(int8_linear_cpu, "cpu_has_vnni", lambda: False)
    keys = {}
    for exact in (False, True):
        monkeypatch.setattr(inductor, "onednn_int8_exact", lambda exact=exact: exact)
        keys[exact] = inductor.InductorBackend().load_versions()["int8_w8a8"]
    assert keys == {False: "float32", True: "onednn"}
