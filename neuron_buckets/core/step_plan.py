"""The step plan: what one engine step computes, as plain data (docs/design.md, "The shared contract").

The scheduler writes it, the runtime runs it and ``nb inspect`` replays it with lengths alone.
Every segment carries its own context and block-table row, so one plan holds any mix of fresh
prompts, continuing chunks, prefix-cache hits and decode rows; fitting it onto the compiled
graphs is the runtime's job, not the plan's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Segment:
    """One request's share of a step: ``token_ids`` written at positions ``context_len``, ...

    Its tokens attend to the ``context_len`` positions already cached in ``block_ids`` and to the
    earlier tokens of the segment; the logits of its last ``num_samples`` tokens come back.
    """

    request_id: int
    token_ids: Sequence[int] | Tensor
    context_len: int
    block_ids: Sequence[int]
    num_samples: int
    lora_slot: int = 0  # the LoRA slot its tokens run with (0: the base model)

    @property
    def end(self) -> int:
        """The context the segment reaches: what was cached plus what it computes."""
        return self.context_len + len(self.token_ids)


StepPlan = tuple[Segment, ...]
