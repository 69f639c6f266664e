"""``[speculative]``: drafting tokens that the target verifies in one decode row (vLLM's names).

``nb compile`` reads ``method`` and ``draft_model`` (a draft model is compiled into the artifact,
and the draft's own manifest records its source) and refuses the rest; those are run-time settings
(``read_by=(RUN,)``), read by ``nb generate`` and ``nb serve`` from the runtime file given with
``--config`` (``config/runtime_file.py``; ``method`` there picks the drafter, ``draft_model`` is
refused), and their ``--speculative-*`` flags override the drafter and ``num_speculative_tokens``.

Off by default (``num_speculative_tokens = 0``). Drafts ride in the ``1 + speculation_length``
positions a decode row already has, so ``num_speculative_tokens`` may not exceed the artifact's
compiled ``buckets.speculation_length``; the engine checks that when it opens the artifact. No
field shapes a graph: the decode rows' width is ``buckets.speculation_length``'s.

``method = "draft_model"`` drafts with a second, smaller checkpoint of the same vocabulary,
``draft_model``: ``nb compile`` builds it into the artifact's ``draft/`` sub-artifact (its own
buckets over the same cache geometry, ``config/draft.py``), and the engine runs it from there.

``auto_off`` (on by default) lets the engine stop drafting while drafts do not pay for the
drafter's time, judged over the last ``auto_off_window`` drafting steps, and draft again after
``auto_off_probe_interval`` steps without (``engine/speculation_gate.py``). Turn it off to draft
every step whatever it costs: then a seeded sampled request's tokens no longer depend on timing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.setting import COMPILE, DECODES, RUN, check_positive, check_types, setting

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    SECTION: ClassVar[str] = "speculative"

    # prompt lookup (no second model), or the draft model: nb compile builds it, a run drafts with it
    method: str = setting("ngram", graph=False, read_by=(COMPILE, RUN), tasks=DECODES)
    num_speculative_tokens: int = setting(0, graph=False, read_by=(RUN,), tasks=DECODES)  # 0 = off
    prompt_lookup_min: int = setting(1, graph=False, read_by=(RUN,), tasks=DECODES)
    prompt_lookup_max: int = setting(4, graph=False, read_by=(RUN,), tasks=DECODES)
    # the draft checkpoint (a directory, as model.path), compiled into the artifact's draft/
    draft_model: Path | None = setting(None, graph=False, tasks=DECODES)
    # stop drafting while it does not pay
    auto_off: bool = setting(True, graph=False, read_by=(RUN,), tasks=DECODES)
    # drafting steps that decide whether it pays
    auto_off_window: int = setting(16, graph=False, read_by=(RUN,), tasks=DECODES)
    # steps off before drafting again
    auto_off_probe_interval: int = setting(128, graph=False, read_by=(RUN,), tasks=DECODES)

    def __post_init__(self) -> None:
        if isinstance(self.draft_model, str):
            object.__setattr__(self, "draft_model", Path(self.draft_model))
        elif self.draft_model is not None and not isinstance(self.draft_model, Path):
            got = self.draft_model
            raise ConfigError(
                f"speculative.draft_model must be a string (a directory or a .gguf file), got {got!r}"
            )
        check_types(self)
        check_positive(self, "auto_off_window", "auto_off_probe_interval")
        if self.method not in METHODS:
            raise ConfigError(f"speculative.method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "speculative.prompt_lookup_min and prompt_lookup_max need 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    def check_fits(self, speculation_length: int) -> None:
        """One line when the drafts do not fit the artifact's decode rows."""
        if self.num_speculative_tokens > speculation_length:
            raise ConfigError(
                f"speculative.num_speculative_tokens = {self.num_speculative_tokens} exceeds the "
                f"artifact's buckets.speculation_length = {speculation_length}: recompile with "
                f"speculation_length >= {self.num_speculative_tokens} or draft fewer tokens"
            )
