"""Compile time against depth: ``nb compile`` of one grid for a 2-layer and a 30-layer model.

Both models have the SmolLM2-135M width (random weights, built with transformers); the grid is
a small serving grid (prefill 64/256, decode batches 1/8, contexts 256
and 512). Each cold run is a fresh ``nb compile --jobs 2`` process with a fresh graph cache and
a fresh inductor cache, as on a new machine. Layer-granular artifacts compile one decoder layer
per bucket whatever the depth, so the ratio should stay near 1 (0.1's whole-model graphs grew
with the depth; CHANGELOG has the figures).
Then a warm no-op ``nb compile`` of the 30-layer directory is timed beside ``python -c "import
torch"``: with nothing to build it should cost at most 1 s more. Its row goes into
``bench/RESULTS.md`` (``--results`` names another file).
Run: python -m bench.bench_compile [--models DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .real_models import build_smollm
from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument

GRID = """
[model]
path = "{model}"

[cache]
block_size = 16
num_blocks = 300
max_model_len = 512

[buckets]
max_num_seqs = 8
max_num_batched_tokens = 256
num_seqs_buckets = [1, 8]
num_batched_tokens_buckets = [64, 256]

[compile]
backend = "inductor"
jobs = 2
"""
TABLE = ResultsTable(
    heading="Compile time against depth (bench_compile.py)",
    about="""
`bench/bench_compile.py`: seconds of a cold `nb compile --jobs 2` (fresh graph and inductor caches,
a process of its own) of one small serving grid (prefill 64/256, decode batches 1/8, contexts 256
and 512: 7 buckets) for SmolLM2-135M-wide models of 2 and 30 layers (target: 30 / 2 at most 2x),
and a warm no-op `nb compile` of the 30-layer directory beside `python -c "import torch"`
(medians of 3; target: at most 1 s more).
""",
    columns=("grid", "cold 2 layers s", "cold 30 layers s", "30 / 2", "warm no-op s", "import torch s",
             "no-op - import s", *PROVENANCE),
    key=1,
    derived={"30 / 2": Ratio("cold 30 layers s", "cold 2 layers s")},
)


def run(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def cold(model: Path, root: Path) -> tuple[float, Path]:
    """Seconds of a first ``nb compile`` of ``model`` with nothing cached anywhere."""
    root.mkdir(parents=True)
    config = root / "nb.toml"
    config.write_text(GRID.format(model=model.as_posix()))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
    env["NB_CACHE_DIR"] = str(root / "cache")
    seconds = run(["nb", "compile", str(config), "--out", str(root / "out")], env)
    return seconds, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-models")
    add_results_argument(parser)
    args = parser.parse_args()
    shallow = build_smollm(args.models / "smollm2-2layers", num_layers=2)
    deep = build_smollm(args.models / "smollm2-30layers", num_layers=30)
    print(f"SmolLM2-135M shape, 2 and 30 layers; 7 buckets, --jobs 2, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="nb-bench-compile-") as tmp:
        root = Path(tmp)
        two, _ = cold(shallow, root / "l2")
        thirty, config = cold(deep, root / "l30")
        print(f"cold nb compile:  2 layers {two:6.1f} s   30 layers {thirty:6.1f} s   "
              f"ratio {thirty / two:.2f}x (target at most 2x; whole-model graphs were 5.85x)")
        env = {**os.environ, "NB_CACHE_DIR": str(root / "l30" / "cache")}
        again = ["nb", "compile", str(config), "--out", str(root / "l30" / "out")]
        warm = [run(again, env) for _ in range(3)]
        torch_import = [run([sys.executable, "-c", "import torch"]) for _ in range(3)]
        w, t = statistics.median(warm), statistics.median(torch_import)
        print(f"warm no-op nb compile {w:.2f} s; python -c 'import torch' {t:.2f} s; "
              f"difference {w - t:+.2f} s (target at most +1 s)")
    TABLE.write(args.results, [["SmolLM2-135M width, 7 buckets, --jobs 2", f"{two:.1f}", f"{thirty:.1f}",
                                f"{w:.2f}", f"{t:.2f}", f"{w - t:+.2f}"]])


if __name__ == "__main__":
    main()
