"""``nb compile --executor ray``: a real two-worker Ray cluster on 127.0.0.1, started and stopped here.

The cluster runs in a process of its own (Ray stays on the loopback address only when told so
before it is imported), with two worker nodes of one CPU each. ``nb compile`` runs as a user
runs it, in a subprocess. One compile on Ray of the embedded default config, narrowed to one
decode and one packed bucket, serves several checks: it matches the local executor's artifact,
and it survives a worker that dies mid-compile. Both compile it without fresh layers. More
buckets or fresh layers would add inductor compiles (CI time) and test nothing Ray does
differently: every piece is a task alike.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.cli import app
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.config import load_config
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.utils.package_data import read_package_data
from tests.conftest import TINY_CONFIG, error_line, free_port, prefill_plan, write_config
from tests.worker_stops import stopped

pytestmark = pytest.mark.xdist_group("ray")
EAGER = TINY_CONFIG.replace('"inductor"', '"eager"')
DEFAULT = read_package_data("default.toml")
GRID = (
    DEFAULT.replace("num_seqs_buckets = [1, 2, 4]", "num_seqs_buckets = [4]")
    .replace('{ strategy = "powers_of_two", min = 32 }', "[128]")
    + "fresh_layers = false\n"  # [compile] is its last section
)
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # keeps every Ray address on 127.0.0.1
# nb compile whose Ray tasks run tests/worker_stops.py's first_dies: Ray workers cannot import the
# tests, so the module travels by value with the task.
DIES = (
    "import ray.cloudpickle, tests.worker_stops as stops\n"
    "from neuron_buckets.cli import app\n"
    "from neuron_buckets.compile.ray_executor import RayExecutor\n"
    "ray.cloudpickle.register_pickle_by_value(stops)\n"
    "RayExecutor.run = staticmethod(stops.first_dies)\n"
    "app()\n"
)
CLUSTER = """
import sys
from ray.cluster_utils import Cluster
node = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}
cluster = Cluster(initialize_head=True, head_node_args={**node, "num_cpus": 0, "include_dashboard": False})
for _ in range(2):
    cluster.add_node(**node, num_cpus=1)
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes it
cluster.shutdown()
"""


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory) -> Iterator[str]:
    pytest.importorskip("ray", reason="Ray is the optional extra neuron-buckets[ray]")
    home = tmp_path_factory.mktemp("ray-nodes")
    proc = subprocess.Popen(
        [sys.executable, "-c", CLUSTER],
        env={**os.environ, **LOOPBACK, "NB_CACHE_DIR": str(home)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), f"the cluster did not start: {address!r}"
        yield address
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def compile_on_ray(address: str, *args: object, cache: Path, dies: bool = False) -> tuple[int, str]:
    """``nb compile --executor ray`` as a user runs it, on the machine whose local cache is
    ``cache``; with ``dies``, the first worker to have built its graph exits before publishing it."""
    command = ["compile", *map(str, args), "--executor", "ray", "--ray-address", address]
    proc = subprocess.run(
        [sys.executable, "-c", DIES if dies else "from neuron_buckets.cli import app; app()", *command],
        env={**os.environ, **LOOPBACK, "NB_CACHE_DIR": str(cache)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
    )
    return proc.returncode, proc.stdout


@pytest.fixture(scope="module")
def ray_compile(ray_address, tmp_path_factory) -> tuple[Path, str]:
    """The narrowed default grid compiled on the cluster, one worker dying mid-compile."""
    root = tmp_path_factory.mktemp("ray-compile")
    (config := root / "nb.toml").write_text(GRID)
    status, log = compile_on_ray(ray_address, config, "--out", root / "out", cache=root / "cache", dies=True)
    assert status == 0, log
    return root / "out", log


@pytest.fixture(scope="module")
def local_compile(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("local-compile")
    (config := root / "nb.toml").write_text(GRID)
    report = Compiler(load_config(config), root / "out", root / "cache").run()
    assert not report.failed
    return root / "out"


@pytest.mark.slow
def test_ray_compiles_the_grid_into_the_local_executors_artifact(ray_compile, local_compile):
    out, log = ray_compile
    on_ray, local = read_manifest(out), read_manifest(local_compile)
    assert "Ray tasks of 1 CPUs" in log
    assert on_ray.pieces.keys() == local.pieces.keys()  # the same keys, piece for piece
    assert [(b.kind, b.batch, b.seq, b.ctx, b.pieces, b.status) for b in on_ray.buckets] == [
        (b.kind, b.batch, b.seq, b.ctx, b.pieces, b.status) for b in local.buckets
    ]
    assert {r.status for r in on_ray.pieces.values()} == {"ok"} and len(on_ray.buckets) == 2
    # AOTInductor packages are not byte-reproducible (a random id and the build's own comments go
    # in), so equal graphs show as equal results: every bucket, from the same inputs.
    ray_rt, local_rt = BucketRuntime.open(out, preload=True), BucketRuntime.open(local_compile, preload=True)
    for length in (20, 100):
        prompt = prefill_plan([(list(range(3, 3 + length)), 0, list(range(1, 1 + -(-length // 16))))])
        torch.testing.assert_close(ray_rt.run_plan(prompt), local_rt.run_plan(prompt))


@pytest.mark.slow
def test_a_worker_that_dies_mid_compile_has_its_piece_retried(ray_compile):
    out, log = ray_compile
    said = " ".join(log.split())
    assert "retry" in said and "(WorkerCrashedError: the worker died);" in said, log
    assert "compiling it again, attempt 2" in said, log
    assert "failed 0" in said
    assert all(b.status == "ok" for b in read_manifest(out).buckets)


@pytest.mark.slow
def test_eager_graphs_from_ray_are_byte_identical_to_local_ones(ray_address, hf_model_dir, tmp_path):
    config = write_config(tmp_path, hf_model_dir, EAGER)
    status, log = compile_on_ray(ray_address, config, "--out", tmp_path / "ray", cache=tmp_path / "ray-cache")
    assert status == 0, log
    Compiler(load_config(config), tmp_path / "local", tmp_path / "local-cache").run(jobs=2)
    shas = [{k: r.sha256 for k, r in read_manifest(tmp_path / d).pieces.items()} for d in ("ray", "local")]
    assert shas[0] == shas[1] and len(shas[0]) == 8


@pytest.mark.slow
def test_a_piece_whose_worker_dies_on_every_attempt_is_recorded_failed_with_the_reason(
    ray_address, compiled_dir, graph_cache_dir, hf_model_dir, tmp_path
):
    """With no retries, one death fails the piece; the session's other pieces are reused."""
    config = write_config(tmp_path, hf_model_dir, TINY_CONFIG + "retries = 0\n")
    compiler = Compiler(load_config(config), tmp_path / "out", tmp_path / "cache")
    target = compiler.plan.bucket_pieces[compiler.plan.buckets[0]]["layer"]
    shared, cache = GraphStore(graph_cache_dir), GraphStore(tmp_path / "cache")
    for shape, key in compiler.plan.keys.items():
        if shape != target:
            entry = shared.read_record(key, "pt2")
            cache.publish(shared.graph_file(entry), entry)
    status, log = compile_on_ray(
        ray_address, config, "--out", tmp_path / "out", "--cache-dir", tmp_path / "cache",
        cache=tmp_path / "local", dies=True,
    )
    assert status == 1, log
    rec = {r.name: r for r in read_manifest(tmp_path / "out").pieces.values()}[target.name]
    assert rec.status == "failed"
    assert rec.error == "WorkerCrashedError: the worker died on each of 1 attempts"
    assert "WorkerCrashedError" in (tmp_path / "out" / rec.log).read_text()
    assert stopped(tmp_path / "cache").exists()  # it died where a graph was built, unpublished
    assert cache.read_record(compiler.plan.keys[target], "pt2") is None  # a failure is never cached


runner = CliRunner()


def test_without_ray_the_message_says_how_to_install_it(hf_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    config = write_config(tmp_path, hf_model_dir, EAGER)
    args = ["compile", config, "--executor", "ray", "--out", tmp_path / "o", "--cache-dir", tmp_path / "c"]
    line = error_line(runner.invoke(app, list(map(str, args))))
    assert "--executor ray needs Ray" in line and "pip install 'neuron-buckets[ray]'" in line


def test_an_unreachable_ray_address_is_one_error_line(hf_model_dir, tmp_path):
    pytest.importorskip("ray", reason="Ray is the optional extra neuron-buckets[ray]")
    config = write_config(tmp_path, hf_model_dir, EAGER)
    address = f"127.0.0.1:{free_port()}"
    args = ["compile", config, "--executor", "ray", "--ray-address", address, "--out", tmp_path / "o",
            "--cache-dir", tmp_path / "c"]
    line = error_line(runner.invoke(app, list(map(str, args))))
    assert f"cannot reach the Ray cluster at {address}" in line
