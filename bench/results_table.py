"""One markdown table of ``bench/RESULTS.md``, merged row by row so that a run of some cells keeps
the others.

The file is sections under ``## `` headings. A table's section is its heading, a paragraph that
says what the rows are, and the table; a row is named by its first ``key`` cells (a matrix cell:
shape, dtype, workload, concurrency), and a new row replaces the old row of the same name in
place. Sections that are not this table's (notes written by hand) are kept as they are.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"  # what `make bench` regenerates
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")  # what decides the kernels
PROVENANCE = ("date (UTC)", "CPU", "nb commit")  # the last columns of every table but the matrix's

HEADER = """# Benchmark results

Written by the benches under `bench/` (each table says which); a run replaces the rows of the
cells it ran and keeps the others, so rows may come from different days, machines and commits:
each row says its own. Every figure is one run on the machine named in its row.
"""


def cpu_description() -> str:
    """The CPU model, its cores, and the flags that decide which kernels run."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in info.splitlines() if ":" in ln)}
    model, flags = fields.get("model name", "unknown CPU"), set(fields.get("flags", "").split())
    return f"{model}, {os.cpu_count()} cores, " + " ".join(f for f in CPU_FLAGS if f in flags)


def commit() -> str:
    """This checkout's commit, ``+changes`` if tracked files other than ``RESULTS`` differ from it
    (a run of several benches writes that file between them)."""
    repo = str(Path(__file__).parents[1])
    head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown"
    results = f":!{RESULTS.relative_to(repo).as_posix()}"
    dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "-uno", "--", ".", results],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+changes" if dirty else "")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M")


def provenance() -> list[str]:
    """The ``PROVENANCE`` cells of a row measured now, here."""
    return [now(), cpu_description(), commit()]


def add_results_argument(parser: argparse.ArgumentParser) -> None:
    """``--results PATH``: where a bench merges its rows (a scratch copy, to check a bench's table)."""
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="the results file to merge the rows into (default: bench/RESULTS.md)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _sections(text: str) -> list[str]:
    """The file's text split before each ``## `` heading (the first part is the header)."""
    parts, current = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith("## ") and current:
            parts.append("".join(current))
            current = []
        current.append(line)
    parts.append("".join(current))
    return parts


@dataclass(frozen=True)
class ResultsTable:
    """A table's heading, its paragraph, its columns, and how many leading columns name a row."""

    heading: str
    about: str
    columns: tuple[str, ...]
    key: int

    def rows(self, path: Path) -> list[list[str]]:
        """The rows the file holds now (none if the file or the table is absent)."""
        for section in _sections(path.read_text()) if path.is_file() else []:
            if section.startswith(f"## {self.heading}\n"):
                lines = [ln for ln in section.splitlines() if ln.startswith("|")]
                return [_cells(ln) for ln in lines[2:]]
        return []

    def merge(self, path: Path, new: list[list[str]]) -> None:
        """Write ``new`` rows into the file: a row of an existing name replaces it, others append."""
        for row in new:
            if len(row) != len(self.columns):
                raise ValueError(f"a row of {self.heading!r} has {len(row)} cells, not {len(self.columns)}")
        rows = self.rows(path)
        names = [r[: self.key] for r in rows]
        for row in new:
            if row[: self.key] in names:
                rows[names.index(row[: self.key])] = row
            else:
                rows.append(row)
                names.append(row[: self.key])
        sections = _sections(path.read_text()) if path.is_file() else [HEADER]
        mine = self.render(rows)
        at = [i for i, s in enumerate(sections) if s.startswith(f"## {self.heading}\n")]
        if at:
            sections[at[0]] = mine
        else:
            sections.insert(1, mine)  # newest table first, before any notes
        text = "".join(s if s.endswith("\n\n") else s.rstrip("\n") + "\n\n" for s in sections)
        path.write_text(text.rstrip("\n") + "\n")

    def write(self, path: Path, rows: list[list[str]]) -> None:
        """Merge rows measured now, here: each gets the ``PROVENANCE`` cells where the columns name
        them (a row holds every other cell, in column order)."""
        at, made = self.columns.index(PROVENANCE[0]), provenance()
        self.merge(path, [[*row[:at], *made, *row[at:]] for row in rows])
        print(f"{len(rows)} rows written to {path}", flush=True)

    def render(self, rows: list[list[str]]) -> str:
        lines = [f"## {self.heading}", "", self.about.strip(), "",
                 "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
        return "\n".join(lines) + "\n"
