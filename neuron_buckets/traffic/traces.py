"""Request traces (prompt and output lengths, optional arrivals) from the CSV and JSONL files
people actually have: the Azure LLM inference traces, Mooncake JSONL and length-only CSVs.

Bucket choices are only as good as the traffic they are fitted to, so a bad file must fail with
one message naming the column, row and value, never load as something subtly different. Parsing
is columnar (``np.loadtxt`` / one ``json.loads``), so a million rows load in about a second.
"""

from __future__ import annotations

import csv
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# (prompt column, output column, format name); the first pair present in the header wins.
LENGTH_COLUMNS = (
    ("ContextTokens", "GeneratedTokens", "azure"),
    ("input_length", "output_length", "mooncake"),
    ("num_prefill_tokens", "num_decode_tokens", "lengths"),
)
TIME_COLUMNS = ("TIMESTAMP", "timestamp")


class TraceError(ValueError):
    """A trace file that cannot be read as requests."""


@dataclass(frozen=True)
class Trace:
    """One request per row: ``prompt_lens`` (>= 1), ``output_lens`` (>= 0), and ``arrivals`` in
    seconds after the first request (None when the file has no time column)."""

    prompt_lens: np.ndarray
    output_lens: np.ndarray
    arrivals: np.ndarray | None
    source: str

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def split(self, fraction: float) -> tuple[Trace, Trace]:
        """The first ``fraction`` of requests by arrival time, and the rest (a holdout set)."""
        if self.arrivals is None:
            raise TraceError("a holdout split needs arrival times; this trace has no timestamp")
        if not 0.0 < fraction < 1.0:
            raise TraceError(f"the holdout split must be strictly between 0 and 1, got {fraction}")
        order = np.argsort(self.arrivals, kind="stable")
        cut = int(round(fraction * len(order)))
        if cut == 0 or cut == len(order):
            raise TraceError(f"split {fraction} of {len(order)} requests leaves one side empty")
        return self._take(order[:cut]), self._take(order[cut:])

    def _take(self, idx: np.ndarray) -> Trace:
        arrivals = self.arrivals[idx] if self.arrivals is not None else None
        return Trace(self.prompt_lens[idx], self.output_lens[idx], arrivals, self.source)


def load_trace(path: str | Path) -> Trace:
    """Read a CSV or JSONL trace (chosen by content: JSONL lines start with ``{``)."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8-sig") as f:
            head = f.readline()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    if not head.strip():
        raise TraceError(f"{path}: empty file (expected a CSV header or JSONL records)")
    loader = _load_jsonl if head.lstrip().startswith("{") else _load_csv
    try:
        return loader(path, head)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None


def _pick_columns(found: list[str]) -> tuple[str, str, str, str | None]:
    for prompt, output, name in LENGTH_COLUMNS:
        if prompt in found and output in found:
            time_col = next((c for c in TIME_COLUMNS if c in found), None)
            return prompt, output, name, time_col
    expected = "; ".join(f"{p}/{o} ({n})" for p, o, n in LENGTH_COLUMNS)
    raise TraceError(f"no recognised length columns; found {found}; expected one of: {expected}")


def _load_csv(path: Path, head: str) -> Trace:
    header = [c.strip() for c in next(csv.reader([head]))]
    prompt, output, name, time_col = _pick_columns(header)

    def column(col: str, dtype: type) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            return np.loadtxt(
                path,
                usecols=header.index(col),
                dtype=dtype,
                delimiter=",",
                skiprows=1,
                quotechar='"',
                ndmin=1,
                encoding="utf-8-sig",
            )

    try:
        lengths = [column(c, np.int64) for c in (prompt, output)]
    except ValueError as fast_error:  # a ragged row or a value that is not an integer: name it
        with path.open(newline="", encoding="utf-8-sig") as f:
            for row, fields in enumerate(csv.reader(f)):
                if fields and len(fields) != len(header):
                    raise TraceError(
                        f"row {row} has {len(fields)} fields, the header has {len(header)}"
                    ) from None
        for c in (prompt, output):
            _parse_ints(c, column(c, str))
        raise TraceError(str(fast_error).splitlines()[0]) from None
    if len(lengths[0]) == 0:
        raise TraceError("the trace holds no requests (header only)")
    arrivals = _parse_times(time_col, column(time_col, str)) if time_col else None
    return _build(prompt, output, lengths[0], lengths[1], arrivals, name)


def _load_jsonl(path: Path, head: str) -> Trace:
    lines = [ln for ln in path.read_text(encoding="utf-8-sig").splitlines() if ln.strip()]
    try:
        records = json.loads("[" + ",".join(lines) + "]")
    except json.JSONDecodeError:
        for i, ln in enumerate(lines, 1):
            try:
                json.loads(ln)
            except json.JSONDecodeError as e:
                raise TraceError(f"record {i} is not valid JSON: {e.msg}") from None
        raise
    if not all(isinstance(r, dict) for r in records):
        raise TraceError("every JSONL line must be an object")
    prompt, output, name, time_col = _pick_columns(list(records[0]))
    missing = object()

    def column(col: str) -> np.ndarray:
        values = np.array([r.get(col, missing) for r in records])
        if values.dtype == object and any(v is missing for v in values):
            row = next(i for i, v in enumerate(values, 1) if v is missing)
            raise TraceError(f"record {row} has no {col!r}")
        return values

    p, o = (_parse_ints(c, column(c)) for c in (prompt, output))
    arrivals = _parse_times(time_col, column(time_col)) if time_col else None
    return _build(prompt, output, p, o, arrivals, name)


def _parse_ints(col: str, values: np.ndarray) -> np.ndarray:
    """Token counts as int64, or a TraceError naming the first value that is not one."""
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    if values.dtype.kind == "f":
        ok = np.isfinite(values) & (values == np.round(values))
    elif values.dtype.kind == "U":
        values = np.strings.strip(values)
        ok = np.strings.isdigit(values) | (
            np.strings.startswith(values, "-") & np.strings.isdigit(np.strings.lstrip(values, "-"))
        )
    else:
        ok = np.array([isinstance(v, int) and not isinstance(v, bool) for v in values])
    if ok.all():
        return values.astype(np.int64)
    row = int(np.argmin(ok))
    raise TraceError(
        f"column {col!r} row {row + 1}: {values[row : row + 1].tolist()[0]!r} is not an integer token count"
    )


def _parse_times(col: str, values: np.ndarray) -> np.ndarray:
    """Arrival seconds after the first request: numbers are milliseconds (Mooncake), strings
    date-times such as Azure's ``2023-11-16 18:17:03.9799600``."""
    if values.dtype.kind == "U":
        try:
            values = values.astype(np.float64)
        except ValueError:
            try:
                stamps = values.astype("datetime64[ns]")
            except ValueError:
                stamps = None
            if stamps is None or np.isnat(stamps).any():
                row = next(i for i, v in enumerate(values) if not _is_datetime(v))
                raise TraceError(
                    f"column {col!r} row {row + 1}: {str(values[row])!r} is not a date-time or a "
                    "number of milliseconds"
                ) from None
            ns = stamps.astype(np.int64)
            return (ns - ns.min()) / 1e9
    if values.dtype.kind not in "iuf" or not np.isfinite(values).all():
        raise TraceError(f"column {col!r} must hold numbers (milliseconds) or date-time strings")
    seconds = values.astype(np.float64) / 1e3
    return seconds - seconds.min()


def _is_datetime(value: str) -> bool:
    try:
        return not np.isnat(np.datetime64(value, "ns"))
    except ValueError:
        return False


def _build(prompt: str, output: str, p: np.ndarray, o: np.ndarray, t: np.ndarray | None, name: str) -> Trace:
    for col, values, least in ((prompt, p, 1), (output, o, 0)):
        if (bad := np.flatnonzero(values < least)).size:
            raise TraceError(
                f"column {col!r} row {bad[0] + 1}: {values[bad[0]]} is below {least} "
                f"({'a prompt needs at least one token' if least else 'negative length'})"
            )
    return Trace(p, o, t, name)
