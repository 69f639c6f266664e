"""The Neuron backend without the SDK (clear refusals), its flags, state wrapper, dispatch, digest."""

from __future__ import annotations

import shutil

import pytest
import torch

from neuron_buckets.backends import BackendUnavailable, get_backend
from neuron_buckets.backends.neuron import NeuronFlags, StackedLayer, core_index, stacked_of
from neuron_buckets.cli.doctor import doctor_report
from neuron_buckets.compile import cache_key
from neuron_buckets.kernels import dispatch
from neuron_buckets.model.checkpoint import DEFAULT_CONFIG
from neuron_buckets.model.pieces import LayerPiece, PieceShape, example_inputs

SDK_PRESENT = get_backend("neuron").available()[0]  # placeholder wheels import-fail: absent
without_sdk = pytest.mark.skipif(SDK_PRESENT, reason="the Neuron SDK is installed here")
INSTALL = "pip install torch-neuronx neuronx-cc nki --extra-index-url https://pip.repos.neuron"


@without_sdk
def test_unavailable_without_the_sdk_says_what_to_install():
    usable, why = get_backend("neuron").available()
    assert not usable
    assert "torch_neuronx" in why and INSTALL in why


@without_sdk
def test_compile_and_load_refuse_at_once_with_the_install_hint(tmp_path):
    backend = get_backend("neuron")
    out = tmp_path / f"graph.{backend.graph_ext}"
    shape = PieceShape("layer", 4, rows=1, ctx=16)
    example = example_inputs(shape, DEFAULT_CONFIG, 16, 4, torch.float32)
    with pytest.raises(BackendUnavailable, match=INSTALL):
        backend.compile(LayerPiece(DEFAULT_CONFIG), example, out, {"target": "trn1"}, None)
    assert not out.exists()
    with pytest.raises(BackendUnavailable, match=INSTALL):
        backend.load(out, {}, "neuron:0")


@without_sdk
def test_doctor_lists_every_backend_and_device_and_why_neuron_is_not_usable():
    lines = {name: (usable, why) for name, usable, why in doctor_report()}
    assert {"inductor", "eager", "neuron", "cuda device", "neuron device"} <= set(lines)
    assert lines["eager"][0]
    assert not lines["neuron"][0] and INSTALL in lines["neuron"][1]
    assert all(why for _, why in lines.values())


def test_versions_name_the_sdk_packages_even_when_absent():
    versions = get_backend("neuron").versions()
    assert versions["torch"] == torch.__version__
    assert {"torch-neuronx", "neuronx-cc", "nki"} <= set(versions)
    if not SDK_PRESENT:
        assert versions["nki"] == "not installed"


def test_flags_fill_defaults_and_map_to_the_neuronx_cc_command_line():
    backend = get_backend("neuron")
    assert backend.resolved_flags({}) == {
        "target": "trn1", "optlevel": 2, "lnc": 1, "auto_cast": "none",
        "model_type": "transformer", "extra_args": [],
    }  # fmt: skip
    args = NeuronFlags.from_dict(
        {"target": "trn2", "optlevel": 3, "lnc": 2, "extra_args": ["--verbose", "info"]}
    ).compiler_args()
    assert args[:6] == ["--target", "trn2", "--optlevel", "3", "--logical-nc-config", "2"]
    assert args[-2:] == ["--verbose", "info"]


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"optimise": 3}, "unknown neuron compile flags .*optimise"),
        ({"target": "inf1"}, "flags.target='inf1'"),
        ({"optlevel": 4}, "flags.optlevel=4"),
        ({"target": "trn1", "lnc": 2}, "flags.lnc=2 with target 'trn1'"),
        ({"auto_cast": "fp8"}, "flags.auto_cast='fp8'"),
        ({"extra_args": [3]}, "flags.extra_args must be strings"),
    ],
)
def test_bad_flags_name_the_key_and_what_is_allowed(flags, message):
    with pytest.raises(ValueError, match=message):
        NeuronFlags.from_dict(flags)


def test_core_index_accepts_only_neuron_devices():
    assert core_index("neuron") == 0 and core_index("neuron:3") == 3
    with pytest.raises(ValueError, match="got 'cpu'"):
        core_index("cpu")


def test_stacked_layer_updates_the_chosen_layer_of_the_stacked_cache_only():
    """What the Neuron layer NEFF computes, run on CPU: layer l of the stacked state, offset by
    slot and block id, gives what the layer piece gives on that layer's own cache slice."""
    config = DEFAULT_CONFIG
    shape = PieceShape("layer", 8, rows=2, ctx=32)
    h, cos, sin, slots, table, lens, seg, k, v, weights = example_inputs(shape, config, 16, 6, torch.float32)
    gen = torch.Generator().manual_seed(0)
    h, cos, sin = (torch.randn(t.shape, generator=gen) for t in (h, cos, sin))
    weights = tuple(torch.randn(w.shape, generator=gen) * 0.1 for w in weights)
    slots = torch.tensor([17, 18, 19, -1, 33, 34, -1, -1])
    table = torch.tensor([[1, -1], [2, -1]])
    lens, seg = torch.tensor([1, 1]), torch.zeros(2, 4, dtype=torch.int64)  # two decode rows
    stacked = [torch.randn(config.num_layers, 6, 16, config.num_kv_heads, config.head_dim, generator=gen)
               for _ in range(2)]
    want_k, want_v = (c[1].clone() for c in stacked)
    want = LayerPiece(config)(h, cos, sin, slots, table, lens, seg, want_k, want_v, weights)
    module = StackedLayer(LayerPiece(config), *(c.clone() for c in stacked))
    got, k_out, v_out = module(torch.tensor(1), h, cos, sin, slots, table, lens, seg, *weights)
    torch.testing.assert_close(got, want)
    assert torch.equal(k_out[1], want_k) and torch.equal(v_out[1], want_v)
    assert torch.equal(k_out[0], stacked[0][0]) and k_out is module.k_cache  # aliased state
    params = dict(module.named_parameters())
    assert module.aliases() == {params["k_cache"]: 1, params["v_cache"]: 2}
    assert stacked_of(stacked[0][1]).data_ptr() == stacked[0].data_ptr()


def test_dispatch_runs_the_goldens_unless_a_backend_swaps_its_kernels_in():
    calls = []
    fake = dispatch.KernelSet(
        "fake",
        lambda *a: calls.append("write"),
        lambda *a: calls.append("attend") or a[0],
    )
    assert dispatch.active() is dispatch.DEFAULT
    with pytest.raises(RuntimeError, match="boom"), dispatch.use(fake):
        dispatch.write_kv_cache(*[torch.zeros(1)] * 5)
        assert dispatch.block_kv_attention(*[torch.ones(1)] * 6, 1.0).item() == 1
        raise RuntimeError("boom")
    assert calls == ["write", "attend"] and dispatch.active() is dispatch.DEFAULT


def test_the_nki_kernel_source_is_in_every_graph_key(tmp_path, monkeypatch):
    real = cache_key.package_sources()
    (nki_src,) = [p for p in real if p.name == "block_kv_nki.py"]
    copy = tmp_path / "kernels" / nki_src.name
    copy.parent.mkdir()
    shutil.copy(nki_src, copy)
    monkeypatch.setattr(cache_key, "package_sources", lambda: [copy if p == nki_src else p for p in real])
    base = cache_key.source_digest()
    copy.write_text(copy.read_text().replace("NEG_INF = -1.0e30", "NEG_INF = -1.0e29"))
    assert cache_key.source_digest() != base
