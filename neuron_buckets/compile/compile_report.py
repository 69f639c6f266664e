"""What one ``nb compile`` did: every piece's outcome and the buckets recorded, the draft's too."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from neuron_buckets.artifact.manifest import BucketRecord
from neuron_buckets.compile.outcome import Outcome


@dataclass
class CompileReport:
    out: Path
    outcomes: list[Outcome] = field(default_factory=list)
    buckets: list[BucketRecord] = field(default_factory=list)
    draft: CompileReport | None = None  # the draft model's sub-artifact, when there is one

    @property
    def all_outcomes(self) -> list[Outcome]:
        """The target's pieces, then the draft model's."""
        return self.outcomes + (self.draft.all_outcomes if self.draft else [])

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.all_outcomes if o.status != "ok"]

    @property
    def compiled(self) -> list[Outcome]:
        return [o for o in self.all_outcomes if o.status == "ok" and not o.cached]
