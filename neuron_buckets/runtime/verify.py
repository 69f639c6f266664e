"""``nb verify``: is an artifact directory intact, and does every graph compute what the model does?

Checks the schema, the weights' and every piece's sha256, then runs each bucket's pieces on random
padded steps (random rows, lengths, starting positions and shuffled blocks, over a cache full of
random values) and compares logits (an embedding artifact's hidden states) and the written cache
with the eager model on the same input; a bucket with a fresh layer piece also runs a step with
nothing cached, which is what that piece serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from neuron_buckets.artifact.manifest import ManifestError, read_manifest
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.core.padding import PaddedCall, pad_decode, pad_prefill
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.model.llama import Llama
from neuron_buckets.runtime.bucket_runtime import ArtifactError, BucketRuntime
from neuron_buckets.utils.files import intact

# The largest difference allowed, relative to the largest magnitude of the eager result (at least 1):
# half precision rounds in proportion to the values, so logits of 5 differ more than logits of 1.
TOLERANCE = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 1e-1}


@dataclass
class BucketCheck:
    name: str
    ok: bool
    max_diff: float | None = None
    detail: str = ""


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max(1, max |want|); NaN where both hold NaN counts as equal, NaN in
    only one of them as infinitely far (a poisoned cache entry read or written where it must not)."""
    got, want = got.float(), want.float()
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return float("inf")
    got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
    return float((got - want).abs().max() / want.abs().max().clamp(min=1))


def poison(cache: torch.Tensor, step: PaddedCall) -> None:
    """NaN in every block of the stacked ``cache`` (layers, blocks, ...) that no real row of
    ``step`` names: a graph that reads one (or writes one that the eager model does not) turns
    its result or the cache NaN where the eager one is not, which no tolerance passes."""
    used = step.block_table[: step.num_rows].flatten()
    keep = torch.zeros(cache.shape[1], dtype=torch.bool)
    keep[used[used >= 0]] = True
    cache[:, ~keep.to(cache.device)] = float("nan")


def file_problems(directory: Path) -> list[str]:
    """Every file whose bytes disagree with the manifest (missing, truncated, tampered)."""
    manifest = read_manifest(directory)
    problems = []
    for rel, digest, what in manifest.files():
        path = directory / rel
        if not path.is_file():
            problems.append(f"{what} file {rel} is missing")
        elif not intact(path, digest):
            problems.append(f"{what} file {rel} does not match its sha256")
    problems += [
        f"bucket {r.bucket.name} failed to compile: {r.error}"
        for r in manifest.buckets
        if r.status != "ok"
    ]
    return problems


def random_step(
    bucket: Bucket, block_size: int, num_blocks: int, vocab: int, gen: torch.Generator, samples: int,
    fresh: bool = False,
) -> PaddedCall:
    """A padded step with 1..batch real requests of random tokens, length, context (none with
    ``fresh``) and shuffled blocks (prefill: packed, each segment over a context of its own;
    ``samples`` logits back).

    The config guarantees the pool holds one full-context row; rows are capped to what it holds.
    """
    max_blocks = bucket.ctx // block_size
    rows = int(torch.randint(1, bucket.batch + 1, (1,), generator=gen))
    rows = min(rows, (num_blocks - 1) // max_blocks or 1)
    if bucket.kind == "prefill":  # packed: every request needs a token of the bucket's run
        rows = min(rows, bucket.seq)
        cuts = sorted(torch.randperm(bucket.seq - 1, generator=gen)[: rows - 1].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, bucket.seq], strict=True)]
        lengths[-1] = int(torch.randint(1, lengths[-1] + 1, (1,), generator=gen))  # a padded tail
    else:
        lengths = [bucket.seq] * rows
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    chunks = []
    for n in lengths:
        start = 0 if fresh else int(torch.randint(0, bucket.ctx - n + 1, (1,), generator=gen))
        need = -(-(start + n) // block_size)
        blocks, free = free[:need], free[need:]
        chunks.append(Segment(len(chunks), torch.randint(0, vocab, (n,), generator=gen), start, blocks, 1))
    if bucket.kind == "decode":
        return pad_decode(chunks, bucket, block_size)
    return pad_prefill(chunks, bucket, block_size, samples)


def verify_graphs(
    directory: Path, trials: int = 2, seed: int = 0, poisoned: bool = False
) -> list[BucketCheck]:
    """Run every bucket graph against the eager model; one result per bucket. ``poisoned``: the
    blocks a step does not name hold NaN (``poison``) instead of random values."""
    if (size := read_manifest(Path(directory)).parallel.tensor_parallel_size) > 1:
        raise ManifestError(f"{directory}: nb verify runs one process's graphs against the eager model; "
                            f"the {size} ranks of a tensor-parallel artifact run together: compare its "
                            f"nb generate output with a tensor_parallel_size 1 artifact's")
    runtime = BucketRuntime.open(directory)
    manifest = runtime.manifest
    dtype = manifest.cache.dtype
    model = Llama(runtime.config, runtime.head.eager_weights(runtime.weights))  # the runtime's own
    gen = torch.Generator().manual_seed(seed)
    vocab = runtime.config.vocab_size
    results = []
    for bucket in sorted(runtime.records):
        try:
            diff = 0.0
            fresh_too = "fresh_layer" in runtime.records[bucket].pieces
            for fresh in [False] * trials + [True] * fresh_too:
                samples = runtime.buckets.samples(bucket)
                step = random_step(bucket, runtime.block_size, runtime.num_blocks, vocab, gen, samples, fresh)
                start = torch.randn(runtime.k_cache.shape, generator=gen).to(runtime.k_cache)
                runtime.k_cache.copy_(start)
                runtime.v_cache.copy_(start.flip(0))
                if poisoned:
                    for cache in (runtime.k_cache, runtime.v_cache):
                        poison(cache, step)
                ref_k, ref_v = runtime.k_cache.clone(), runtime.v_cache.clone()
                got = runtime.head.sampled(runtime.run(bucket, step), step)
                with torch.no_grad():
                    args = [t.to(runtime.device) for t in step.args()]
                    want = model(*args, ref_k, ref_v)[: step.num_samples]
                diff = max(
                    diff,
                    relative_diff(got, want),
                    relative_diff(runtime.k_cache, ref_k),
                    relative_diff(runtime.v_cache, ref_v),
                )
            ok = diff <= TOLERANCE[dtype]
            results.append(BucketCheck(bucket.name, ok, diff, "" if ok else f"exceeds {TOLERANCE[dtype]}"))
        except (ArtifactError, ManifestError, RuntimeError, ValueError) as e:
            results.append(BucketCheck(bucket.name, False, None, str(e)))
    return results
