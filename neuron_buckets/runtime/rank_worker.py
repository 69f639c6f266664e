"""A follower rank of a tensor-parallel artifact: ``python -m neuron_buckets.runtime.rank_worker DIR``.

Rank 0 (``nb serve``, ``nb generate``, ``BucketRuntime.open``) starts one per other rank on its
machine; on other machines it is started with torch.distributed's rendezvous variables
(``rank_group.py``). Under ``torchrun`` every rank runs the same command, so ``nb generate`` and
``nb serve`` become this follower where ``RANK`` names another rank than 0 (``follows``). It opens
the artifact as its rank (its shard of the weights and of the KV cache), then runs every plan rank
0 sends, until rank 0 ends the group or is gone. A failure is one line on stderr and exit status 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from neuron_buckets.artifact.manifest import read_manifest


def follows(directory: Path) -> bool:
    """Whether this process is to follow rank 0 of the tensor-parallel artifact ``directory``: the
    rendezvous variables (torchrun's, or set by hand) name another rank than 0."""
    if os.environ.get("RANK", "0") == "0":
        return False
    return read_manifest(directory).parallel.tensor_parallel_size > 1


def follow(directory: Path) -> int:
    """Run as a follower rank until rank 0 ends the group; the exit status."""
    from neuron_buckets.runtime.bucket_runtime import BucketRuntime

    try:
        BucketRuntime.open(directory).follow()
    except Exception as e:  # any failure ends this rank with one line; rank 0 sees it lost
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: rank {os.environ.get('RANK', '?')}: {first}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m neuron_buckets.runtime.rank_worker ARTIFACT_DIR", file=sys.stderr)
        return 2
    return follow(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
