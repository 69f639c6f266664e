"""Where to sample: the head piece's work against host sampling of the logits it returns.

NxD Inference samples inside the graph to avoid moving (rows x vocab) logits off a device. On
CPU the logits are already in host memory, so what decides is the cost of sampling itself next
to the step. This times, for real vocabulary and hidden sizes (random weights), the head piece's
work (final RMSNorm and the LM-head matmul) for a batch of rows, and ``engine/sampler.py`` on its
logits for each kind of request, and prints the bytes a device would have to move. Peaked logits
(scaled x10, as a trained model's usually are) let top-p stop at the 1024 largest candidates;
flat ones make it sort the whole vocabulary. Prints its figures and writes them into
``bench/RESULTS.md`` (``--results`` names another file); nothing is asserted.
Run: python -m bench.bench_sampling
"""

from __future__ import annotations

import argparse
import timeit

import torch
import torch.nn.functional as F

from neuron_buckets.engine.sampler import sample
from neuron_buckets.engine.sampling_params import SamplingParams

from .results_table import PROVENANCE, ResultsTable, add_results_argument

SHAPES = {"SmolLM2-135M": (576, 49152), "Qwen2.5-0.5B": (896, 151936), "Llama-3.2-1B": (2048, 128256)}
CASES = {
    "greedy": (SamplingParams(), 1.0),
    "temp 0.8": (SamplingParams(temperature=0.8), 1.0),
    "top-k 50": (SamplingParams(temperature=0.8, top_k=50), 1.0),
    "top-p .9 peaked": (SamplingParams(temperature=0.8, top_p=0.9), 10.0),
    "top-p .9 flat": (SamplingParams(temperature=0.8, top_p=0.9), 1.0),
}

TABLE = ResultsTable(
    heading="Sampling on the host (bench_sampling.py)",
    about="""
`bench/bench_sampling.py`: milliseconds per step of the head piece's work (final RMSNorm and the
LM head, random weights) against host sampling of its logits, per kind of request; float32, one
thread, best of 3 autoranged loops. "logits MB" is what a device would move to the host.
""",
    columns=("model", "rows", "head ms", *(f"{c} ms" for c in CASES), "logits MB", *PROVENANCE),
    key=2,
)


def best_ms(fn, repeat: int = 3) -> float:
    """Best of ``repeat`` autoranged loops: the figure least disturbed by other load."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e3


def bench_model(hidden: int, vocab: int, rows: int, gen: torch.Generator) -> list[float]:
    """Milliseconds of the head's work, then of sampling each case, for one step of ``rows``."""
    weight = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5
    norm, h = torch.ones(hidden), torch.randn(rows, hidden, generator=gen)
    logits = F.rms_norm(h, (hidden,), norm) @ weight.T
    times = [best_ms(lambda: F.rms_norm(h, (hidden,), norm) @ weight.T)]
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    for params, scale in CASES.values():
        scaled = logits * scale
        times.append(best_ms(lambda s=scaled, p=params: sample(s, [p] * rows, gens, [[]] * rows)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_argument(parser)
    results = parser.parse_args().results
    # One thread for both: on a shared machine, intra-op threads mostly measure the other load.
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32; milliseconds per step")
    print(f"{'model':14} {'rows':>4} {'head':>8} " + " ".join(f"{c:>15}" for c in CASES) + "  logits MB")
    table = []
    for model, (hidden, vocab) in SHAPES.items():
        for rows in (1, 8, 32):
            head, *times = bench_model(hidden, vocab, rows, gen)
            cells = " ".join(f"{t:15.2f}" for t in times)
            print(f"{model:14} {rows:>4} {head:8.2f} {cells}  {rows * vocab * 4 / 1e6:9.1f}")
            table.append([model, str(rows), f"{head:.2f}", *(f"{t:.2f}" for t in times),
                          f"{rows * vocab * 4 / 1e6:.1f}"])
    TABLE.write(results, table)


if __name__ == "__main__":
    main()
