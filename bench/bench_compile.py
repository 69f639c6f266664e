"""How long ``nb compile`` takes on the embedded default grid: cold with 1 and 2 jobs, then warm.

Each cold run gets a fresh graph cache and a fresh inductor cache (TORCHINDUCTOR_CACHE_DIR), so
nothing is reused between the two runs and the figures are a first compile on a new machine (the
first graph of a run also pays inductor's one-time CPU-ISA probe and precompiled header). The
warm run repeats the 2-job compile on its directory: it should find every graph and compile
nothing. Prints figures only; timing varies by machine and load, so nothing is asserted.
Run: python bench/bench_compile.py [--flags '{"compile_threads": 1}']
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from neuron_buckets.compile.compiler import Compiler, CompileReport
from neuron_buckets.config import Config, load_config


def timed_compile(config: Config, out: Path, cache: Path, jobs: int) -> tuple[float, CompileReport]:
    """Wall seconds of what ``nb compile`` does after start-up: build, key, compile, write."""
    start = time.perf_counter()
    report = Compiler(config, out, cache).run(jobs)
    seconds = time.perf_counter() - start
    if report.failed:
        raise SystemExit(f"{len(report.failed)} buckets failed: {report.failed[0].error} (see {out})")
    return seconds, report


def cold(config: Config, root: Path, jobs: int) -> tuple[float, CompileReport]:
    run = root / f"jobs{jobs}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(run / "inductor")  # inherited by the workers
    seconds, report = timed_compile(config, run / "out", run / "cache", jobs)
    per_graph = [o.compile_seconds for o in report.compiled]
    print(
        f"cold --jobs {jobs}: {seconds:7.1f} s for {len(per_graph)} graphs; per graph "
        f"min {min(per_graph):.1f} / median {statistics.median(per_graph):.1f} / max {max(per_graph):.1f} s "
        f"({', '.join(f'{o.bucket.name} {o.compile_seconds:.1f}' for o in report.compiled)})"
    )
    return seconds, report


def warm_cli(run: Path) -> float:
    """The whole ``nb compile`` process on a compiled directory, interpreter and torch import included."""
    start = time.perf_counter()
    subprocess.run(
        ["nb", "compile", "--out", str(run / "out"), "--cache-dir", str(run / "cache")],
        check=True, capture_output=True,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flags", type=json.loads, default={}, help="inductor flags, as JSON")
    args = parser.parse_args()
    config = load_config()
    config = replace(config, compile=replace(config.compile, backend="inductor", flags=args.flags))
    print(f"embedded default grid, backend inductor, flags {args.flags}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="nb-bench-compile-") as tmp:
        root = Path(tmp)
        one, _ = cold(config, root, jobs=1)
        two, _ = cold(config, root, jobs=2)
        print(f"speedup --jobs 2 over --jobs 1: {one / two:.2f}x")
        warm, report = timed_compile(config, root / "jobs2" / "out", root / "jobs2" / "cache", 2)
        print(f"warm --jobs 2: {warm:.2f} s, {len(report.compiled)} graphs compiled; "
              f"warm/cold = {warm / two:.2%} (target below 2%)")
        if args.flags:  # nb compile has no --flags: it would key (and compile) every graph anew
            return
        whole = warm_cli(root / "jobs2")
        print(f"warm, whole `nb compile` process: {whole:.2f} s; warm/cold = {whole / two:.2%}")


if __name__ == "__main__":
    main()
