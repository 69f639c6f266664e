"""A follower rank of a tensor-parallel artifact: ``python -m neuron_buckets.runtime.rank_worker DIR``.

Rank 0 (``nb serve``, ``nb generate``, ``BucketRuntime.open``) starts one per other rank on its
machine; on other machines it is started with torch.distributed's rendezvous variables
(``rank_group.py``). Under ``torchrun`` every rank runs the same command, so ``nb generate`` and
``nb serve`` become this follower where ``RANK`` names another rank than 0 (``follower``). It opens
the artifact as its rank (its shard of the weights and of the KV cache), then runs every plan rank
0 sends, until rank 0 ends the group or is gone. A failure is one line on stderr and exit status 1.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from neuron_buckets.artifact.manifest import Manifest, read_manifest


def other_rank() -> bool:
    """Whether the rendezvous variables (torchrun's, or set by hand) name another rank than 0: only
    then may this process follow, so only then need it read the manifest before anything else."""
    return os.environ.get("RANK", "0") != "0"


@dataclass(frozen=True)
class RankFollower:
    """This process's part in a tensor-parallel artifact whose rank 0 is another process."""

    directory: Path
    manifest: Manifest

    def run(self) -> None:
        """Follow rank 0 until it ends the group; a failure ends the process with one line and
        exit status 1 (rank 0 sees this rank lost)."""
        from neuron_buckets.runtime.bucket_runtime import BucketRuntime

        try:
            BucketRuntime.open(self.directory, manifest=self.manifest).follow()
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"error: rank {os.environ.get('RANK', '?')}: {first}", file=sys.stderr)
            raise SystemExit(1) from None


def follower(directory: Path, manifest: Manifest | None = None) -> RankFollower | None:
    """The follower this process is for the artifact ``directory`` (its ``manifest`` if read
    already), or None where it is rank 0 or the artifact is not tensor-parallel. Rank 0 reads
    nothing here."""
    if not other_rank():
        return None
    manifest = manifest or read_manifest(directory)
    return RankFollower(Path(directory), manifest) if manifest.parallel.tensor_parallel_size > 1 else None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m neuron_buckets.runtime.rank_worker ARTIFACT_DIR", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    RankFollower(directory, read_manifest(directory)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
