"""What ``make test`` costs a fresh clone: wall time and disk, before and after torch-xla left it.

Until the StableHLO tests covered every piece, ``make test`` ended with ``make test-xla``, which
builds a second virtualenv (torch and torch-xla 2.9) inside the clone. This bench clones the
repository twice, at ``--before`` (default: the parent of the commit that took ``$(MAKE) test-xla``
out of the Makefile's ``test`` target) and at ``--after`` (default: HEAD), and runs ``make test`` in
each, one run apiece (a run is the whole suite; the disk figures do not move between runs, the
wall seconds are one run's). Each run gets an empty pip cache of its own, so every wheel a
run installs beyond the main environment is downloaded as on a fresh machine. Recorded per run:
wall seconds, the clone's size afterwards (its virtualenvs and build outputs included), the pip
cache it filled, and whether it passed. The main environment (torch 2.13 and the ``dev`` extra) and
the real-model fixture are the same on both sides, installed before either run, and counted in
neither. The main environment's editable install is pointed back at this checkout at the end.

    python -m bench.bench_test_cost [--before REV] [--after REV]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument

ROOT = Path(__file__).parents[1]
XLA_STEP = "$(MAKE) test-xla"  # the line of the Makefile's test target that ran the torch-xla tests

TABLE = ResultsTable(
    heading="What make test costs a fresh clone (bench_test_cost.py)",
    about="""
`bench/bench_test_cost.py`: `make test` on a fresh clone at the last commit whose `test` target
ran `make test-xla` (**before**: it builds `.venv-xla`, torch and torch-xla 2.9) and at the
commit named (**after**), one run each (a whole suite a run; disk does not move between runs). Disk
is the clone after the run (its virtualenvs and build outputs) plus the pip cache it filled from
empty; the main environment and the real-model fixture, the same for both, are in neither.
""",
    columns=("commit before", "commit after", "wall s before", "wall s after",
             "wall after / before", "clone GB before", "clone GB after", "pip cache GB before",
             "pip cache GB after", "disk GB before", "disk GB after", "disk after / before",
             "passed before / after", *PROVENANCE),
    key=2,
    derived={
        "wall after / before": Ratio("wall s after", "wall s before"),
        "disk after / before": Ratio("disk GB after", "disk GB before"),
    },
)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def last_commit_with_xla() -> str:
    """The parent of the newest commit that changed whether the Makefile holds ``XLA_STEP``."""
    changed = git("log", "-S", XLA_STEP, "--format=%H", "--", "Makefile").split()
    if not changed:
        raise SystemExit("no commit of this history ran make test-xla from make test")
    return git("rev-parse", "--short", f"{changed[0]}^")


def size_gb(path: Path) -> float:
    """Bytes on disk under ``path`` (du), in GB."""
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1e9


def make_test(rev: str, work: Path, log: Path) -> dict[str, float]:
    """One ``make test`` on a fresh clone at ``rev``, with an empty pip cache of its own."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        clone, cache = Path(tmp) / "clone", Path(tmp) / "pip-cache"
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", rev], check=True)
        env = {**os.environ, "PIP_CACHE_DIR": str(cache)}
        started = time.monotonic()
        with log.open("a") as out:
            out.write(f"== make test at {rev}\n")
            out.flush()
            rc = subprocess.run(["make", "test"], cwd=clone, env=env, stdout=out,
                                stderr=subprocess.STDOUT).returncode
        wall = time.monotonic() - started
        print(f"make test at {rev}: rc {rc} in {wall:.0f} s", flush=True)
        return {"wall": wall, "clone": size_gb(clone), "cache": size_gb(cache) if cache.exists() else 0.0,
                "passed": float(rc == 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="default: the last commit whose make test ran make test-xla")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--log", type=Path, default=Path("bench-test-cost.log"))
    add_results_argument(parser)
    args = parser.parse_args()
    revs = {"before": args.before or last_commit_with_xla(), "after": git("rev-parse", "--short", args.after)}
    runs = {}
    try:
        with tempfile.TemporaryDirectory(prefix="nb-bench-test-cost-") as tmp:
            for name, rev in revs.items():
                runs[name] = make_test(rev, Path(tmp), args.log)
    finally:  # make test pointed the editable install at each clone
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
                       check=True)
    disk = {n: r["clone"] + r["cache"] for n, r in runs.items()}
    row = [revs["before"], revs["after"], *(f"{runs[n]['wall']:.0f}" for n in revs),
           *(f"{runs[n]['clone']:.2f}" for n in revs), *(f"{runs[n]['cache']:.2f}" for n in revs),
           *(f"{disk[n]:.2f}" for n in revs),
           " / ".join("yes" if runs[n]["passed"] else "no" for n in revs)]
    TABLE.write(args.results, [row])


if __name__ == "__main__":
    main()
