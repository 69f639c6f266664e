"""How long the per-step host work takes: slot mapping and padding, on realistic block tables.

Slot mapping and padding run on the host before every graph call, so they must stay far below a
decode step's device time. Prints its figures and writes them into ``bench/RESULTS.md`` (``--results``
names another file); timing varies by machine, so nothing is asserted.
Run: python -m bench.bench_slot_mapping
"""

from __future__ import annotations

import argparse
import timeit

import torch

from neuron_buckets.core.block_table import compute_slot_mapping
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.core.padding import pad_decode, pad_prefill
from neuron_buckets.core.step_plan import Segment

from .results_table import PROVENANCE, ResultsTable, add_results_argument

BLOCK_SIZE = 16
CTX = 4096  # tokens of context per request; 256 blocks per block-table row
gen = torch.Generator().manual_seed(0)
TABLE = ResultsTable(
    heading="Host work per step (bench_slot_mapping.py)",
    about=f"""
`bench/bench_slot_mapping.py`: the host work before every graph call, on block tables drawn from a
shuffled pool (block_size {BLOCK_SIZE}, {CTX} tokens of context per request), one thread, best of 7
autoranged loops.
""",
    columns=("work", "shape", "µs", *PROVENANCE),
    key=2,
)


def shuffled_tables(rows: int) -> torch.Tensor:
    """Each request owns CTX // BLOCK_SIZE physical blocks drawn from a shuffled pool (no block 0)."""
    per_row = CTX // BLOCK_SIZE
    return (torch.randperm(rows * per_row, generator=gen) + 1).reshape(rows, per_row)


def best_seconds(fn, repeat: int = 7) -> float:
    """Best of ``repeat`` runs of an autoranged loop: the figure least disturbed by other load."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeat, number=number)) / number


def bench_slot_mapping(num_tokens: int = 65_536) -> list[str]:
    rows = num_tokens // CTX  # 16 requests of 4096 tokens each
    table = shuffled_tables(rows)
    req_indices = torch.arange(rows).repeat_interleave(CTX)
    positions = torch.arange(CTX).repeat(rows)
    seconds = best_seconds(lambda: compute_slot_mapping(table, req_indices, positions, BLOCK_SIZE))
    print(
        f"compute_slot_mapping  {num_tokens:>6} tokens  {seconds * 1e3:8.3f} ms  "
        f"{seconds * 1e6 / (num_tokens / 1000):8.2f} us per 1000 tokens"
    )
    return ["compute_slot_mapping", f"{num_tokens} tokens", f"{seconds * 1e6:.0f}"]


def bench_pad_decode(rows: int = 64) -> list[str]:
    """Requests at random context lengths, each holding the blocks its tokens need, as a pool hands out."""
    table = shuffled_tables(rows)
    starts = torch.randint(0, CTX - 1, (rows,), generator=gen).tolist()
    step = [Segment(r, [1], s, table[r, : s // BLOCK_SIZE + 1].tolist(), 1) for r, s in enumerate(starts)]
    bucket = Bucket("decode", rows, 1, CTX)
    seconds = best_seconds(lambda: pad_decode(step, bucket, BLOCK_SIZE))
    print(f"pad_decode            {rows:>3} rows x 1 token into {bucket.name}  {seconds * 1e6:8.1f} us")
    return ["pad_decode", f"{rows} rows x 1 token into {bucket.name}", f"{seconds * 1e6:.1f}"]


def bench_pad_prefill(tokens: int = 4096) -> list[str]:
    """A 4000-token prompt padded to the 4096-token bucket."""
    real = tokens - 96
    blocks = shuffled_tables(1)[0, : -(-real // BLOCK_SIZE)].tolist()
    chunk = Segment(0, torch.randint(0, 32000, (real,), generator=gen), 0, blocks, 1)
    bucket = Bucket("prefill", 1, tokens, CTX)
    seconds = best_seconds(lambda: pad_prefill([chunk], bucket, BLOCK_SIZE))
    print(f"pad_prefill          {real} tokens into {bucket.name}  {seconds * 1e6:8.1f} us")
    return ["pad_prefill", f"{real} tokens into {bucket.name}", f"{seconds * 1e6:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_argument(parser)
    results = parser.parse_args().results
    # One thread: the runtime's host thread does this work, and intra-op threads on tensors this
    # small only add noise (and oversubscribe a machine that is compiling graphs meanwhile).
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, block_size {BLOCK_SIZE}")
    rows = [bench_slot_mapping(), bench_pad_decode(), bench_pad_prefill()]
    TABLE.write(results, rows)


if __name__ == "__main__":
    main()
