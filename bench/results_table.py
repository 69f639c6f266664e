"""One markdown table of ``bench/RESULTS.md``, merged row by row so that a run of some cells keeps
the others.

The file is sections under ``## `` headings. A table's section is its heading, a paragraph that
says what the rows are, and the table; a row is named by its first ``key`` cells (a matrix cell:
shape, dtype, workload, concurrency), and a new row replaces the old row of the same name in
place. Sections that are not this table's are kept as they are. Notes written by hand about a run
go to dated files under ``bench/notes/``, never into the file.

A table's ratio columns are ``Ratio`` formulas of its raw columns: ``write`` computes them from the
row's cells as written, and ``mismatches`` recomputes every committed one, so a hand-edited figure
or ratio shows.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"  # what `make bench` regenerates
NOTES = Path(__file__).parent / "notes"  # notes written by hand about runs, one dated file each
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")  # what decides the kernels
PROVENANCE = ("date (UTC)", "CPU", "nb commit")  # the last columns of every table but the matrix's
PEERS = ("nb threads", "vLLM CPU settings")  # after PROVENANCE in a table whose rows ran vLLM beside nb
NOT_RECORDED = "not recorded"  # a cell of a row written before its column existed
VLLM_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # unset: vLLM's auto, which keeps a core for its engine

HEADER = """# Benchmark results

Written by the benches under `bench/` (each table says which); a run replaces the rows of the
cells it ran and keeps the others, so rows may come from different days, machines and commits:
each row says its own. Every figure is one run on the machine named in its row, or, in a row
with a `rounds` column, the median of that many alternating runs. A cell that reads
"not recorded" belongs to a row written before the bench wrote that column. Every ratio column is
its row's raw columns divided as `bench/results_table.py` declares, and `tests/test_results_figures.py`
recomputes each.

Threads and peers: a row that ran a peer names the threads nb computed on (`nb threads`: torch's
threads, every core unless `OMP_NUM_THREADS` says less) and the peer's settings. vLLM CPU runs at
its `default`, which on x86 keeps a core for its engine process and computes on the others (on a
2-core machine, one model thread), and at `all-cores` (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`), a row
each, with the binding its log reported; nb is judged against the faster. Rows written before the
two settings ran vLLM at its default only: on those 2-core machines, one core against nb's
two. Serving rows with a `rounds`
column are medians over alternating rounds; `rounds` 1 marks a single run from before them.

Notes written by hand about the runs are in [notes/](notes/), one dated file each:
"""


def header() -> str:
    """The file's opening: what it holds, and a link to each note under ``NOTES``, newest day first."""
    notes = sorted(NOTES.glob("*.md"), reverse=True)
    return HEADER + "\n" + "".join(f"- [{n.read_text().splitlines()[0].removeprefix('# ')}](notes/{n.name})\n"
                                    for n in notes)


def foreign_sections(path: Path, tables: list[ResultsTable]) -> list[str]:
    """The parts of the file no bench writes: an opening other than ``header()``, and each section
    that is none of ``tables``."""
    sections = _sections(path.read_text())
    found = [] if sections[0].rstrip("\n") == header().rstrip("\n") else ["the opening is not header()"]
    headings = {f"## {t.heading}" for t in tables}
    return found + [s.splitlines()[0] for s in sections[1:] if s.splitlines()[0] not in headings]


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


def nb_threads(env: Mapping[str, str]) -> str:
    """The threads nb computes on under ``env``: torch's own count there, which nb serve keeps (its
    graphs cap it at 256)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, env=dict(env), check=True)
    return out.stdout.strip()


def vllm_settings(env: Mapping[str, str]) -> str:
    """vLLM CPU's variables in ``env``, the thread binding named even where it is left to vLLM."""
    settings = {VLLM_THREADS_BIND: "unset (auto)"}
    settings |= {k: v for k, v in env.items() if k.startswith("VLLM_CPU_")}
    return " ".join(f"{k}={v}" for k, v in sorted(settings.items()))


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


_NUMBER = re.compile(r"-?\d+(?:\.(\d+))?%?")


def _number(cell: str) -> tuple[float, float] | None:
    """A cell's number and half its last shown digit (the rounding it was written with), or None."""
    match = _NUMBER.fullmatch(cell.strip())
    if not match:
        return None
    return float(cell.strip().rstrip("%")), 0.5 * 10.0 ** -len(match[1] or "")


@dataclass(frozen=True)
class Ratio:
    """A derived column: the number of column ``top`` over that of ``bottom``; with no ``bottom``,
    ``top`` holds a pair "a / b" and the ratio is a / b. Written with ``digits`` and ``suffix``."""

    top: str
    bottom: str | None = None
    digits: int = 2
    suffix: str = "x"

    def operands(self, row: Mapping[str, str]) -> tuple[str, str]:
        if self.bottom is not None:
            return row[self.top], row[self.bottom]
        pair = row[self.top].split(" / ")
        return (pair[0], pair[1]) if len(pair) == 2 else (row[self.top], "")

    def cell(self, row: Mapping[str, str]) -> str:
        """The ratio of the row's cells as written; "not recorded" or "-" where one is not a number."""
        a, b = self.operands(row)
        if NOT_RECORDED in (a, b):
            return NOT_RECORDED
        x, y = _number(a), _number(b)
        return f"{x[0] / y[0]:.{self.digits}f}{self.suffix}" if x and y and y[0] else "-"

    def holds(self, row: Mapping[str, str], written: str) -> bool:
        """Whether ``written`` is the ratio of the row's cells: what ``cell`` gives, or (a row whose
        ratio was taken before its cells were rounded) a ratio of numbers that round to them."""
        if written == self.cell(row):
            return True
        a, b = (_number(c) for c in self.operands(row))
        r = _number(written.removesuffix(self.suffix)) if written.endswith(self.suffix) else None
        if not (a and b and r) or b[0] - b[1] <= 0 or f"{r[0]:.{self.digits}f}{self.suffix}" != written:
            return False
        low, high = (a[0] - a[1]) / (b[0] + b[1]), (a[0] + a[1]) / (b[0] - b[1])
        slack = 1e-9 * max(1.0, abs(r[0]))
        return r[0] - r[1] - slack <= high and low <= r[0] + r[1] + slack


@dataclass(frozen=True)
class ResultsTable:
    """A table's heading, its paragraph, its columns, how many leading columns name a row, and its
    ratio columns as formulas of the others (the one definition the writer and the check share)."""

    heading: str
    about: str
    columns: tuple[str, ...]
    key: int
    derived: Mapping[str, Ratio] = field(default_factory=dict)

    def __post_init__(self) -> None:
        named = {c for r in self.derived.values() for c in (r.top, r.bottom) if c is not None}
        if unknown := (set(self.derived) | named) - set(self.columns):
            raise ValueError(f"{self.heading!r}: derived columns name no column {sorted(unknown)}")

    def section(self, path: Path) -> str | None:
        """The table's section of the file as it stands, or None."""
        sections = _sections(path.read_text()) if path.is_file() else []
        return next((s for s in sections if s.startswith(f"## {self.heading}\n")), None)

    def rows(self, path: Path) -> list[list[str]]:
        """The rows the file holds now (none if the file or the table is absent)."""
        section = self.section(path)
        return [_cells(ln) for ln in [ln for ln in (section or "").splitlines() if ln.startswith("|")][2:]]

    def mismatches(self, path: Path) -> tuple[list[str], int]:
        """What in the file's section this table would not have written: a header or paragraph other
        than its own, a row of the wrong width, a ratio its row's cells do not give; and how many
        ratio cells were checked."""
        section = self.section(path)
        if section is None:
            return [], 0
        found, checked = [], 0
        if section.split("\n|", 1)[0] != self.render([]).split("\n|", 1)[0]:
            found.append(f"{self.heading}: not the paragraph and columns its bench writes")
        for cells in self.rows(path):
            if len(cells) != len(self.columns):
                found.append(f"{self.heading}: a row of {len(cells)} cells, not {len(self.columns)}: {cells}")
                continue
            row = dict(zip(self.columns, cells, strict=True))
            for column, ratio in self.derived.items():
                checked += 1
                if not ratio.holds(row, row[column]):
                    found.append(f"{self.heading}: {column} {row[column]!r} is not what its row gives "
                                 f"({ratio.cell(row)!r}), in the row {cells[: self.key]}")
        return found, checked

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
        sections = _sections(path.read_text()) if path.is_file() else [""]
        sections[0] = header()
        mine = self.render(rows)
        at = [i for i, s in enumerate(sections) if s.startswith(f"## {self.heading}\n")]
        if at:
            sections[at[0]] = mine
        else:
            sections.insert(1, mine)  # newest table first
        text = "".join(s if s.endswith("\n\n") else s.rstrip("\n") + "\n\n" for s in sections)
        path.write_text(text.rstrip("\n") + "\n")

    def write(self, path: Path, rows: list[list[str]], envs: Mapping[str, Mapping[str, str]] | None = None
              ) -> None:
        """Merge rows measured now, here: each gets the ``PROVENANCE`` cells, the ``PEERS`` cells
        from the environments ``envs`` of the servers that ran ("nb", "vLLM"; "-" for one that did
        not) where the columns name them, and its ratio cells (a row holds every other cell, in
        column order)."""
        made = dict(zip(PROVENANCE, provenance(), strict=True))
        if PEERS[0] in self.columns:
            if envs is None:
                raise ValueError(f"{self.heading!r}: its rows need the servers' environments")
            made |= {PEERS[0]: nb_threads(envs["nb"]) if "nb" in envs else "-",
                     PEERS[1]: vllm_settings(envs["vLLM"]) if "vLLM" in envs else "-"}
        raw = [c for c in self.columns if c not in made and c not in self.derived]
        full = []
        for row in rows:
            if len(row) != len(raw):
                raise ValueError(f"a row of {self.heading!r} has {len(row)} cells, not {len(raw)}")
            cells = made | dict(zip(raw, row, strict=True))
            cells |= {column: ratio.cell(cells) for column, ratio in self.derived.items()}
            full.append([cells[c] for c in self.columns])
        self.merge(path, full)
        print(f"{len(rows)} rows written to {path}", flush=True)

    def render(self, rows: list[list[str]]) -> str:
        lines = [f"## {self.heading}", "", self.about.strip(), "",
                 "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
        return "\n".join(lines) + "\n"
