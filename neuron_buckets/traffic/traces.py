"""Request traces (prompt and output lengths, optional arrivals) from the CSV and JSONL files
people actually have: the Azure LLM inference traces, Mooncake JSONL and length-only CSVs.

Bucket choices are only as good as the traffic they are fitted to, so a bad file must fail with
one message naming the column, row and value, never load as something subtly different. Parsing
is columnar (``np.loadtxt`` / one ``json.loads``), so a million rows load in about a second.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neuron_buckets.utils.ascii_int import parse_ascii_int
from neuron_buckets.utils.errors import brief

# (prompt column, output column, format name); the first pair present in the header wins.
LENGTH_COLUMNS = (
    ("ContextTokens", "GeneratedTokens", "azure"),
    ("input_length", "output_length", "mooncake"),
    ("num_prefill_tokens", "num_decode_tokens", "lengths"),
)
TIME_COLUMNS = ("TIMESTAMP", "timestamp")
CACHED_COLUMN = "cached_tokens"  # a JSONL trace nb serve recorded: prompt tokens found in its prefix cache
# Far beyond any context length, and small enough that the float64 padding counters stay exact
# over a million requests: a count near int64's max overflowed them into "0.0% padding".
MAX_TOKEN_COUNT = 2**32
GZIP_MAGIC = b"\x1f\x8b"
OTHER_ARCHIVES = (
    (b"PK\x03\x04", "zip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"7z\xbc\xaf\x27\x1c", "7z"),
)
TAR_MAGIC, TAR_MAGIC_AT = b"ustar", 257
FORMATS = "nb reads CSV or JSONL traces, plain or gzip-compressed"
# The most a compressed trace may expand to. Public traces are tens of MB; a 1.5 MB gzip "bomb"
# holds a GiB of zeros, and parsing what it expands to takes several times that in memory.
MAX_GUNZIPPED_BYTES = 256 << 20


class TraceError(ValueError):
    """A trace file that cannot be read as requests."""


@dataclass(frozen=True)
class Trace:
    """One request per row: ``prompt_lens`` (>= 1), ``output_lens`` (>= 0), and ``arrivals`` in
    seconds after the first request (None when the file has no time column). ``hash_ids`` (a
    Mooncake trace's) name each request's prompt blocks, so that equal ids mean equal content:
    the prefix information a prefix-caching replay needs; None for traces without it.
    ``cached_lens`` (a trace ``nb serve`` recorded) are the prompt tokens each request found in
    the server's prefix cache, which its prefill did not compute; None when not recorded."""

    prompt_lens: np.ndarray
    output_lens: np.ndarray
    arrivals: np.ndarray | None
    source: str
    hash_ids: tuple[tuple[int, ...], ...] | None = None
    cached_lens: np.ndarray | None = None

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

    def servable(self, max_model_len: int) -> Trace:
        """The requests a server with this ``max_model_len`` runs as recorded: prompt plus output
        (at least one token) within it. It refuses the others, so figures leave them out."""
        fits = self.prompt_lens + np.maximum(self.output_lens, 1) <= max_model_len
        return self if fits.all() else self._take(np.flatnonzero(fits))

    def _take(self, idx: np.ndarray) -> Trace:
        arrivals = self.arrivals[idx] if self.arrivals is not None else None
        hashes = tuple(self.hash_ids[i] for i in idx) if self.hash_ids is not None else None
        cached = self.cached_lens[idx] if self.cached_lens is not None else None
        return Trace(self.prompt_lens[idx], self.output_lens[idx], arrivals, self.source, hashes, cached)

    @property
    def prefill_lens(self) -> np.ndarray:
        """The prompt tokens each request's prefill computed: all but its prefix-cache hit (the
        last prompt token is always computed)."""
        if self.cached_lens is None:
            return self.prompt_lens
        return np.maximum(self.prompt_lens - self.cached_lens, 1)


def load_trace(path: str | Path) -> Trace:
    """Read a CSV or JSONL trace, plain or gzip-compressed (chosen by content: JSONL lines start
    with ``{``, gzip files with its magic bytes)."""
    path = Path(path)
    text = _read_text(path)
    head = text.split("\n", 1)[0]
    if not head.strip():
        raise TraceError(f"{path}: empty file (expected a CSV header or JSONL records)")
    loader = _load_jsonl if head.lstrip().startswith("{") else _load_csv
    try:
        return loader(text)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None


def _read_text(path: Path) -> str:
    """The file as text: gzip is decompressed; other archives and binary files are named."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    if data.startswith(GZIP_MAGIC):
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
                data = f.read(MAX_GUNZIPPED_BYTES + 1)  # never more than the cap in memory
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{path}: a damaged gzip file ({e})") from None
        if len(data) > MAX_GUNZIPPED_BYTES:
            raise TraceError(f"{path}: expands to more than {MAX_GUNZIPPED_BYTES >> 20} MiB; "
                             f"decompress it yourself if it really is a trace that large")
    elif kind := next((name for magic, name in OTHER_ARCHIVES if data.startswith(magic)), None):
        raise TraceError(f"{path} is a {kind} archive; {FORMATS}")
    if data[TAR_MAGIC_AT : TAR_MAGIC_AT + len(TAR_MAGIC)] == TAR_MAGIC:  # a .tar, or the inside of a .tar.gz
        raise TraceError(f"{path} is a tar archive; {FORMATS}")
    if (nul := data.find(b"\0")) >= 0:  # valid UTF-8, but no text: its "columns" would be binary
        raise TraceError(f"{path}: binary data, not text (a NUL byte at {nul}); {FORMATS}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text (at byte {e.start}); {FORMATS}") from None


def _pick_columns(found: list[str]) -> tuple[str, str, str, str | None]:
    for prompt, output, name in LENGTH_COLUMNS:
        if prompt in found and output in found:
            time_col = next((c for c in TIME_COLUMNS if c in found), None)
            return prompt, output, name, time_col
    expected = "; ".join(f"{p}/{o} ({n})" for p, o, n in LENGTH_COLUMNS)
    raise TraceError(f"no recognised length columns; found {found}; expected one of: {expected}")


def _csv_rows(lines: list[str]) -> list[list[str]]:
    """csv.reader over ``lines``, its errors (a field over 128 KiB) naming the line."""
    reader = csv.reader(lines)
    try:
        return list(reader)
    except csv.Error as e:
        raise TraceError(f"line {reader.line_num}: {e}") from None


def _data_lines(text: str, skip: int) -> Callable[[int], int]:
    """Data row (0-based) -> its line in the file, blank lines being no rows; for messages only,
    so the lines are counted only when one is needed."""
    return lambda row: [n for n, ln in enumerate(text.splitlines(), 1) if ln.strip()][skip + row]


def _load_csv(text: str) -> Trace:
    header = [c.strip() for c in _csv_rows([text.split("\n", 1)[0]])[0]]
    prompt, output, name, time_col = _pick_columns(header)
    line_of = _data_lines(text, skip=1)

    def column(col: str, dtype: type) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            return np.loadtxt(
                io.StringIO(text),
                usecols=header.index(col),
                dtype=dtype,
                delimiter=",",
                skiprows=1,
                quotechar='"',
                ndmin=1,
            )

    try:
        raw = [column(c, np.int64) for c in (prompt, output)]
    except ValueError as fast_error:  # a ragged row or a value that is not an integer: name it
        for row, fields in enumerate(_csv_rows(text.splitlines())):
            if fields and len(fields) != len(header):
                raise TraceError(
                    f"row {row} has {len(fields)} fields, the header has {len(header)}"
                ) from None
        for c in (prompt, output):
            _parse_ints(c, column(c, str), line_of)
        raise TraceError(str(fast_error).splitlines()[0]) from None
    lengths = [_parse_ints(c, values, line_of) for c, values in zip((prompt, output), raw, strict=True)]
    if len(lengths[0]) == 0:
        raise TraceError("the trace holds no requests (header only)")
    arrivals = _parse_times(time_col, column(time_col, str)) if time_col else None
    return _build(prompt, output, lengths[0], lengths[1], arrivals, name)


def _load_jsonl(text: str) -> Trace:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    try:
        records = json.loads("[" + ",".join(lines) + "]")
    except ValueError:  # JSONDecodeError, or an integer of more digits than Python converts
        for i, ln in enumerate(lines, 1):
            try:
                json.loads(ln)
            except ValueError as e:
                raise TraceError(f"record {i} is not valid JSON: {getattr(e, 'msg', e)}") from None
        raise
    if not all(isinstance(r, dict) for r in records):
        raise TraceError("every JSONL line must be an object")
    prompt, output, name, time_col = _pick_columns(list(records[0]))
    missing = object()

    def column(col: str) -> list[object]:
        values = [r.get(col, missing) for r in records]
        if row := next((i for i, v in enumerate(values, 1) if v is missing), None):
            raise TraceError(f"record {row} has no {col!r}")
        return values

    line_of = _data_lines(text, skip=0)
    p, o = (_parse_ints(c, column(c), line_of) for c in (prompt, output))
    arrivals = _parse_times(time_col, np.array(column(time_col))) if time_col else None
    trace = _build(prompt, output, p, o, arrivals, name)
    hashes = _hash_ids(column("hash_ids")) if "hash_ids" in records[0] else None
    cached = None
    if CACHED_COLUMN in records[0]:
        cached = _parse_ints(CACHED_COLUMN, column(CACHED_COLUMN), line_of)
    if cached is not None and (bad := np.flatnonzero((cached < 0) | (cached > p))).size:
        raise TraceError(f"record {bad[0] + 1}: {CACHED_COLUMN} {cached[bad[0]]} is not between 0 and its "
                         f"{prompt} {p[bad[0]]}")
    return Trace(trace.prompt_lens, trace.output_lens, trace.arrivals, name, hashes, cached)


def _hash_ids(values: list[object]) -> tuple[tuple[int, ...], ...]:
    """Mooncake's ``hash_ids``: per record, a list of non-negative integer block ids."""
    out = []
    for row, ids in enumerate(values, 1):
        if not isinstance(ids, list) or any(type(h) is not int or h < 0 for h in ids):
            shown = repr(ids)[:80]
            raise TraceError(f"record {row}: hash_ids must be a list of non-negative integers, got {shown}")
        out.append(tuple(ids))
    return tuple(out)


def _token_count(value: object) -> int | None:
    """A JSON integer (never a bool or a float) or an ASCII integer string, else None."""
    if type(value) is int:
        return value
    return parse_ascii_int(value) if isinstance(value, str) else None


def _parse_ints(col: str, values: np.ndarray | list[object], line_of: Callable[[int], int]) -> np.ndarray:
    """Token counts as int64, or a TraceError naming the first value that is not one, its row
    and its line. Counts beyond MAX_TOKEN_COUNT (int64 overflow included) are refused."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":  # parsed by np.loadtxt
        counts = values.astype(np.int64)
    else:
        given = values.tolist() if isinstance(values, np.ndarray) else values
        parsed = [_token_count(v) for v in given]
        if (row := next((i for i, v in enumerate(parsed) if v is None), None)) is not None:
            raise TraceError(
                f"column {col!r} row {row + 1}: {brief(given[row])} is not an integer token count "
                f"(line {line_of(row)})"
            )
        if (row := next((i for i, v in enumerate(parsed) if abs(v) > MAX_TOKEN_COUNT), None)) is not None:
            raise _too_large(col, row, given[row], line_of)
        counts = np.array(parsed, dtype=np.int64)
    if (big := np.flatnonzero(np.abs(counts) > MAX_TOKEN_COUNT)).size:
        raise _too_large(col, int(big[0]), int(counts[big[0]]), line_of)
    return counts


def _too_large(col: str, row: int, value: object, line_of: Callable[[int], int]) -> TraceError:
    return TraceError(
        f"column {col!r} row {row + 1}: {brief(value)} is beyond {MAX_TOKEN_COUNT:,}, the largest "
        f"token count nb takes (line {line_of(row)})"
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
                    f"column {col!r} row {row + 1}: {brief(str(values[row]))} is not a date-time or a "
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
