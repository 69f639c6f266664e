"""``[buckets]``: the step shapes that get a compiled graph (vLLM-neuron's names).

Each list left out (None) is derived: ``num_seqs_buckets`` powers of two up to ``max_num_seqs``,
``num_batched_tokens_buckets`` ``default_token_buckets`` of ``max_num_batched_tokens``, and the
decode contexts ``default_contexts`` of the cache. No field is a graph setting: they decide which
buckets exist, and each piece's key holds its own shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from neuron_buckets.config.bucket_sizes import bucket_sizes
from neuron_buckets.config.setting import DECODES, check_positive, check_types, setting
from neuron_buckets.core.bucket import powers_of_two

# Requests in one decode call when a config does not say: the config's default and ``nb plan``'s.
DEFAULT_MAX_NUM_SEQS = 4
# Prefill token buckets a config gets when it lists none: the budget and its halvings. On the shipped
# Azure traces at a 512-token budget, one bucket pads 21% (conv) / 13% (code) of the real prompt tokens,
# four pad 6.4% / 4.4%, and a fifth saves under half a point more for two more layer pieces; at serving
# time a short prompt, or a short suffix after a cached prefix, runs a call its own size.
DEFAULT_TOKEN_BUCKETS = 4
# Below this, a smaller context saves less attention than another set of decode graphs costs.
MIN_DEFAULT_CONTEXT = 256


def default_contexts(block_size: int, max_model_len: int) -> tuple[int, ...]:
    """Decode contexts that keep a step's attention near its real context: powers of two from
    ``MIN_DEFAULT_CONTEXT`` (a block multiple) up to ``max_model_len``."""
    lo = -(-MIN_DEFAULT_CONTEXT // block_size) * block_size
    if lo >= max_model_len:
        return (max_model_len,)
    return tuple(c for c in powers_of_two(lo, max_model_len) if c % block_size == 0)


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """``max_num_batched_tokens`` and its ``DEFAULT_TOKEN_BUCKETS - 1`` halvings (rounded up)."""
    return tuple(sorted({-(-max_num_batched_tokens // 2**i) for i in range(DEFAULT_TOKEN_BUCKETS)}))


@dataclass(frozen=True)
class BucketConfig:
    SECTION: ClassVar[str] = "buckets"

    # requests in a decode call or a packed prefill
    max_num_seqs: int = setting(DEFAULT_MAX_NUM_SEQS, graph=False)
    max_num_batched_tokens: int = setting(128, graph=False)  # the token budget of a prefill step
    num_seqs_buckets: tuple[int, ...] | None = setting(None, graph=False, tasks=DECODES)  # decode batch sizes
    num_batched_tokens_buckets: tuple[int, ...] | None = setting(None, graph=False)  # prefill tokens
    speculation_length: int = setting(0, graph=False, tasks=DECODES)
    # Bounded by the cache, so ``Config`` derives, expands (a list or strategy table until then) and
    # checks it.
    decode_context_length_buckets: tuple[int, ...] | None = setting(None, graph=False, tasks=DECODES)

    def __post_init__(self) -> None:
        check_types(self)
        check_positive(self, "max_num_seqs", "max_num_batched_tokens")
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        self._derive("num_seqs_buckets", "max_num_seqs", tuple(powers_of_two(1, seqs)))
        self._derive("num_batched_tokens_buckets", "max_num_batched_tokens", default_token_buckets(tokens))

    def _derive(self, name: str, limit: str, default: tuple[int, ...]) -> None:
        """The list ``name`` as given or ``default``, ending at the setting ``limit``."""
        spec, last = getattr(self, name), getattr(self, limit)
        key, limit_key = f"{self.SECTION}.{name}", f"{self.SECTION}.{limit}"
        sizes = default if spec is None else bucket_sizes(key, spec, last, limit_key)
        object.__setattr__(self, name, sizes)
