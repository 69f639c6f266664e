"""``PrefillChunk``: the one input of ``BucketRuntime.prefill``, a convenience for scripts.

The public contract names it, so it stays importable from the package root. It is not a step
form: ``prefill`` turns its chunks into a ``StepPlan`` at once, and the engine builds plans itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class PrefillChunk:
    """One request's chunk: ``token_ids`` written at positions ``start_pos``, ... over
    ``block_ids``; ``prefill`` makes it a segment sampling its last token."""

    token_ids: Sequence[int] | Tensor
    start_pos: int
    block_ids: Sequence[int]
