"""The rank group of an artifact that is not tensor-parallel: one process, alone.

It answers as ``RankGroup`` does (rank 0 of 1, leading, sending to nobody), so the runtime runs
every artifact the same way and never asks whether it has ranks; ``join_ranks`` picks the group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neuron_buckets.core.step_plan import StepPlan
from neuron_buckets.runtime.rank_group import RankGroup


class SoloRank:
    """Rank 0 of a group of one: nothing to hand out, wait for, or leave."""

    rank, size, leads = 0, 1, True
    preloads = False  # nobody waits on it in a collective while it loads a graph on first use

    def loaded(self) -> None:
        """No other rank to wait for."""

    def send(self, plan: StepPlan) -> None:
        """No follower to hand ``plan`` to."""

    def receive(self) -> StepPlan | None:
        """Nobody sends it a plan: it leads."""
        return None

    @contextmanager
    def in_step(self) -> Iterator[None]:
        """A failed step leaves no other rank behind: its error stands as it is."""
        yield

    def close(self) -> None:
        """No follower to end."""

    def abandon(self) -> None:
        """No group to leave."""


def join_ranks(directory: Path, size: int) -> RankGroup | SoloRank:
    """The ranks that open the artifact ``directory`` of ``size`` ranks (this process's place)."""
    return RankGroup.join(directory, size) if size > 1 else SoloRank()
