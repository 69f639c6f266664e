"""Trace loading: the shared Azure traces, the other accepted shapes, and one clear error per
kind of bad file."""

from __future__ import annotations

import csv
import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from neuron_buckets.traffic.traces import TraceError, load_trace

# The Azure LLM inference traces ship with the tests (CC-BY 4.0, see data/traces/PROVENANCE.md).
TRACES = Path(__file__).parent / "data" / "traces"


def tar_of(name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


TAR = tar_of("trace.csv", b"input_length,output_length\n5,1\n")  # what a .tar.gz of a trace holds
CODE, CONV = TRACES / "AzureLLMInferenceTrace_code.csv", TRACES / "AzureLLMInferenceTrace_conv.csv"


def _plain_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(("path", "rows", "median"), [(CODE, 8819, 1469), (CONV, 19366, 1020)])
def test_azure_traces_load_as_published(path: Path, rows: int, median: int) -> None:
    trace = load_trace(path)
    plain = _plain_rows(path)
    assert len(trace) == rows == len(plain)
    assert trace.source == "azure"
    assert trace.prompt_lens.tolist() == [int(r["ContextTokens"]) for r in plain]
    assert trace.output_lens.tolist() == [int(r["GeneratedTokens"]) for r in plain]
    assert np.median(trace.prompt_lens) == median  # PROVENANCE.md's p50
    assert trace.arrivals is not None and trace.arrivals[0] == 0.0
    assert np.all(np.diff(trace.arrivals) >= 0)
    assert 3400 < trace.arrivals[-1] < 3600  # about one hour


def test_azure_timestamps_keep_sub_millisecond_resolution(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319601,3180,8\n"
        "2023-11-16 18:18:03.9799600,110,27\n"
    )
    trace = load_trace(f)
    assert trace.arrivals.tolist() == pytest.approx([0.0, 0.0520001, 60.0], abs=1e-9)
    assert trace.prompt_lens.dtype == np.int64


def test_mooncake_jsonl_and_length_csv_give_the_same_requests(tmp_path: Path) -> None:
    prompts, outputs, ms = [12, 4000, 7], [3, 0, 90], [1000, 0, 2500]
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text(
        "\n".join(
            json.dumps({"timestamp": t, "input_length": p, "output_length": o, "hash_ids": [1]})
            for t, p, o in zip(ms, prompts, outputs, strict=True)
        )
        + "\n\n"
    )
    lengths = tmp_path / "l.csv"
    lengths.write_text(
        "num_prefill_tokens,num_decode_tokens\n"
        + "".join(f"{p},{o}\n" for p, o in zip(prompts, outputs, strict=True))
    )
    mooncake, plain = load_trace(jsonl), load_trace(lengths)
    assert (mooncake.source, plain.source) == ("mooncake", "lengths")
    for t in (mooncake, plain):
        assert t.prompt_lens.tolist() == prompts and t.output_lens.tolist() == outputs
    assert mooncake.arrivals.tolist() == [1.0, 0.0, 2.5]  # ms -> s after the first arrival
    assert plain.arrivals is None


def test_split_by_arrival_time(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text(
        "timestamp,input_length,output_length\n" + "".join(f"{t},{t + 1},1\n" for t in [40, 0, 30, 10, 20])
    )
    head, tail = load_trace(f).split(0.6)
    assert head.prompt_lens.tolist() == [1, 11, 21]
    assert tail.prompt_lens.tolist() == [31, 41]
    for bad in (0.0, 1.0, 0.01):
        with pytest.raises(TraceError, match="split"):
            load_trace(f).split(bad)


def test_split_needs_arrivals(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens\n5,1\n6,1\n")
    with pytest.raises(TraceError, match="arrival times"):
        load_trace(f).split(0.5)


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
LENGTHS = "num_prefill_tokens,num_decode_tokens\n"
MOONCAKE = '{{"input_length": {}, "output_length": {}}}\n'
ROW = "2023-11-16 18:17:03.9799600,"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("\n\n", "empty file"),
        (HEADER, "no requests"),
        ("when,prompt,answer\n1,2,3\n", r"found \['when', 'prompt', 'answer'\]"),
        ("ContextTokens,other\n1,2\n", r"found \['ContextTokens', 'other'\].*GeneratedTokens"),
        (HEADER + ROW + "10,1\n" + ROW + "-5,1\n", "'ContextTokens' row 2: -5 is below 1"),
        (HEADER + ROW + "10,-1\n", "'GeneratedTokens' row 1: -1 is below 0"),
        (HEADER + ROW + "0,1\n", "row 1: 0 is below 1 .a prompt needs at least one token"),
        (HEADER + ROW + "10,1\n" + ROW + "12.5,1\n", r"'ContextTokens' row 2: '12.5' is not an integer"),
        (HEADER + ROW + "ten,1\n", "'ContextTokens' row 1: 'ten' is not an integer"),
        (HEADER + ROW + ",1\n", "'ContextTokens' row 1: '' is not an integer"),
        (HEADER + ROW + "10,1\n" + ROW + "10\n", "row 2 has 2 fields, the header has 3"),
        (HEADER + "yesterday,10,1\n", "'TIMESTAMP' row 1: 'yesterday' is not a date-time"),
        ('{"input_length": 5, "output_length": 1}\n{"input_length": 7}\n', "record 2 has no 'output_length'"),
        ('{"input_length": 5.5, "output_length": 1}\n', "'input_length' row 1: 5.5 is not an integer"),
        ('{"input_length": 5, "output_length": 1}\n{"input_length": \n', "record 2 is not valid JSON"),
        ('{"input_length": -2, "output_length": 1}\n', "'input_length' row 1: -2 is below 1"),
        # nothing silently reinterpreted: bools, floats, full-width digits, counts past int64
        (LENGTHS + "5,1\n6,99999999999999999999\n", r"row 2: '9+' is beyond .* takes \(line 3\)"),
        (LENGTHS + "9223372036854775807,1\n", r"row 1: 9223372036854775807 is beyond 4,294,967,296"),
        (LENGTHS + "1" * 5000 + ",1\n", r"row 1: '1111.*\(5002 characters\) is beyond"),
        (LENGTHS + "\uff11\uff12,1\n", "row 1: '\uff11\uff12' is not an integer token count"),
        (LENGTHS + "5,1\n\n7,1\n8,1_0\n", r"row 3: '1_0' is not an integer token count \(line 5\)"),
        (MOONCAKE.format(5, 1) + MOONCAKE.format(6, "true"), r"row 2: True is not an integer"),
        (MOONCAKE.format(5, "1e30"), r"'output_length' row 1: 1e\+30 is not an integer token count"),
        (MOONCAKE.format(5, "5.0"), r"'output_length' row 1: 5.0 is not an integer token count"),
        (MOONCAKE.format(2**64, 1), r"'input_length' row 1: 18446744073709551616 is beyond"),
        (MOONCAKE.format("1" * 5000, 1), r"record 1 is not valid JSON: Exceeds the limit \(4300 digits\)"),
        (LENGTHS + "5," + "1" * 140_000 + "\n", r"line 2: field larger than field limit \(131072\)"),
    ],
)
def test_bad_traces_get_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(f)
    assert str(info.value).startswith(str(f)) and "\n" not in str(info.value)


def test_a_gzip_bomb_is_refused_before_it_is_held_in_memory(tmp_path: Path, monkeypatch) -> None:
    """Probe 6: a 1.5 MB gzip of a GiB passed 4 GB of memory; the expansion is capped as it is read."""
    import neuron_buckets.traffic.traces as traces

    monkeypatch.setattr(traces, "MAX_GUNZIPPED_BYTES", 1 << 20)
    bomb = tmp_path / "bomb.csv.gz"
    bomb.write_bytes(gzip.compress(b"input_length,output_length\n" + b"0" * (8 << 20)))
    with pytest.raises(TraceError, match=r"bomb.csv.gz: expands to more than 1 MiB"):
        load_trace(bomb)
    ok = tmp_path / "ok.csv.gz"
    ok.write_bytes(gzip.compress(b"input_length,output_length\n" + b"5,1\n" * 1000))
    assert len(load_trace(ok)) == 1000


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.csv")


def test_gzip_traces_load_like_plain_ones(tmp_path: Path) -> None:
    text = "timestamp,input_length,output_length\n0,12,3\n1000,4000,0\n"
    plain, packed = tmp_path / "t.csv", tmp_path / "t.csv.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    a, b = load_trace(plain), load_trace(packed)
    assert a.prompt_lens.tolist() == b.prompt_lens.tolist() == [12, 4000]
    assert a.arrivals.tolist() == b.arrivals.tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (gzip.compress(b"input_length,output_length\n5,1\n")[:-6], "a damaged gzip file"),
        (b"PK\x03\x04" + bytes(40), "is a zip archive; nb reads CSV or JSONL traces, plain or gzip"),
        (b"\x28\xb5\x2f\xfd" + bytes(40), "is a zstd archive"),
        (b"input_length,output_length\n\xff\xfe5,1\n", r"not UTF-8 text \(at byte 27\); nb reads CSV"),
        (gzip.compress(TAR), "is a tar archive; nb reads CSV or JSONL traces, plain or gzip"),
        (TAR, "is a tar archive"),
        (b"input_length,output_length\n5,1\0\0\n", r"binary data, not text \(a NUL byte at 30\); nb reads"),
    ],
    ids=["damaged-gzip", "zip", "zstd", "binary", "tar-gz", "tar", "nul"],
)
def test_other_formats_are_refused_by_name(tmp_path: Path, data: bytes, message: str) -> None:
    f = tmp_path / "trace.gz"
    f.write_bytes(data)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(f)
    assert str(info.value).startswith(str(f))
