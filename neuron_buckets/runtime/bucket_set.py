"""The compiled buckets of an artifact, and how a step plan is laid onto them, on lengths alone.

The runtime runs the calls that ``BucketSet.calls`` lists and ``nb inspect`` counts them, so what
the replay predicts is what the runtime does. A segment that returns the logits of every token
it computes, at most ``decode_seq`` of them, is a decode row: rows of similar context share a
call, each call as wide as the widest decode bucket, on the smallest context bucket that holds
its deepest row. Every other segment is a prefill chunk: chunks are laid end to end in the
smallest token bucket that holds them, up to ``max_rows`` per call, each over its own
block-table row and context (docs/design.md, "The shared contract"), so fresh prompts, continuing chunks and
prefix-cache hits share a call. A chunk longer than the largest token bucket runs as waves:
wave k holds the k-th piece of every such chunk, and runs after wave k - 1 wrote the cache the
piece attends to. A chunk returns the logits of its last ``num_samples`` tokens: its last one
when it ends its prompt, or all of them for a request that asked for its prompt's logprobs,
which the call's head returns in as many calls as they take (no other graph).
Mixed steps (``mix_decode``, on): when the plan has prefill chunks, its decode rows ride in the
last call of the first wave if they all fit there (rows and tokens) on the bucket that call takes
anyway, so the step streams the weights once; a decode-only step, or rows that would grow the
call's bucket, take the decode graphs: riding saves a second pass over the weights, but rows that
grow a call's bucket cost that call more than their own decode graph would. The runtime mixes only
where the attention is the C++ kernel (a CPU, any dtype it reads), which reads each rider's own
context: flex attention reads every segment over the whole table, so there a ride costs more than
the decode call it saves (docs/design.md, "Mixed steps"; CHANGELOG has the figures).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from neuron_buckets.core.bucket import Bucket, NoBucketFits, select_bucket
from neuron_buckets.core.padding import PaddedCall, pad_decode, pad_prefill
from neuron_buckets.core.step_plan import Segment


@dataclass(frozen=True)
class Part:
    """Tokens ``[offset, offset + tokens)`` of the plan's segment ``segment``, computed by one call."""

    segment: int
    offset: int
    tokens: int


@dataclass(frozen=True)
class Call:
    """One graph call: a bucket and the parts of segments it computes, in the bucket's order."""

    bucket: Bucket
    parts: tuple[Part, ...]

    @property
    def real_tokens(self) -> int:
        return sum(p.tokens for p in self.parts)


@dataclass(frozen=True)
class BucketSet:
    """Prefill and decode buckets, each ascending; the token budget and row bound they imply."""

    prefill: tuple[Bucket, ...]
    decode: tuple[Bucket, ...]
    mix_decode: bool = True  # decode rows ride in the prefill call where they grow no bucket
    prefill_only: bool = False  # an embedding artifact's: it never decodes

    @classmethod
    def of(cls, buckets: Iterable[Bucket], mix_decode: bool = True, prefill_only: bool = False) -> BucketSet:
        ordered = sorted(buckets)
        prefill = tuple(b for b in ordered if b.kind == "prefill")
        return cls(prefill, tuple(b for b in ordered if b.kind == "decode"), mix_decode, prefill_only)

    def __post_init__(self) -> None:
        if not self.prefill or not (self.decode or self.prefill_only):
            decode = "" if self.prefill_only else " and one decode"
            raise ValueError(f"needs at least one working prefill{decode} bucket")

    @property
    def token_budget(self) -> int:
        """The most tokens one prefill call computes: the largest token bucket."""
        return self.prefill[-1].seq

    @property
    def max_rows(self) -> int:
        """The most chunks one prefill call packs."""
        return max(b.batch for b in self.prefill)

    @property
    def decode_seq(self) -> int:
        """Token positions per decode row: 1 + speculation_length (1 without decode buckets)."""
        return self.decode[0].seq if self.decode else 1

    @property
    def plan_shape(self) -> tuple[int, int, int]:
        """What the scheduler plans with: the token budget, the rows and the decode width."""
        return self.token_budget, self.max_rows, self.decode_seq

    def is_decode(self, segment: Segment) -> bool:
        return segment.num_samples == len(segment.token_ids) <= self.decode_seq

    def part_samples(self, plan: Sequence[Segment], part: Part) -> int:
        """Logits ``part`` returns: a decode row all its tokens, a chunk those of its tokens that
        are among its segment's last ``num_samples`` (the last piece's last token, usually; every
        token of a chunk that returns its prompt's logits)."""
        seg = plan[part.segment]
        if self.is_decode(seg):
            return len(seg.token_ids)
        first = len(seg.token_ids) - seg.num_samples  # the segment's first token that returns logits
        return max(0, part.offset + part.tokens - max(first, part.offset))

    def chunks(self, plan: Sequence[Segment], call: Call) -> list[Segment]:
        """The segments ``call`` runs: each part's tokens, as a segment of its own that starts
        where the part does and returns the part's logits."""
        return [
            Segment(
                p.segment,
                plan[p.segment].token_ids[p.offset : p.offset + p.tokens],
                plan[p.segment].context_len + p.offset,
                plan[p.segment].block_ids,
                self.part_samples(plan, p),
            )
            for p in call.parts
        ]

    def padded(self, plan: Sequence[Segment], call: Call, block_size: int) -> PaddedCall:
        """The parts of the plan's segments that ``call`` runs, padded to its bucket."""
        chunks = self.chunks(plan, call)
        if call.bucket.kind == "decode":
            return pad_decode(chunks, call.bucket, block_size)
        return pad_prefill(chunks, call.bucket, block_size, self.samples(call.bucket))

    def samples(self, bucket: Bucket) -> int:
        """Logits one head call of ``bucket`` returns (its head's sample count); a packed call
        whose chunks ask for more runs the head again for each further group of them."""
        return bucket.samples(self.decode_seq)

    def calls(self, plan: Sequence[Segment]) -> list[Call]:
        """The graph calls that compute ``plan``, in the order they must run: prefill waves (the
        decode rows riding in the first where they fit), then decode. NoBucketFits for a segment
        no bucket can compute, before any call is listed."""
        decode = [i for i, s in enumerate(plan) if self.is_decode(s)]
        prefill = [i for i, s in enumerate(plan) if not self.is_decode(s)]
        waves = [self._pack(wave) for wave in self._waves(plan, prefill)]
        riders = [Part(i, 0, len(plan[i].token_ids)) for i in decode]
        if self.mix_decode and waves and riders and self._rides(waves[0][-1], riders):
            waves[0][-1].extend(riders)
            decode = []
        packed = [self._call(parts) for wave in waves for parts in wave]
        return packed + self._group_decode(plan, decode)

    def _waves(self, plan: Sequence[Segment], indices: Sequence[int]) -> list[list[Part]]:
        """Pieces of at most ``token_budget`` tokens: wave k holds the k-th piece of every chunk."""
        waves: list[list[Part]] = []
        for i in indices:
            n = len(plan[i].token_ids)
            for k, lo in enumerate(range(0, n, self.token_budget)):
                if k == len(waves):
                    waves.append([])
                waves[k].append(Part(i, lo, min(self.token_budget, n - lo)))
        return waves

    def _fits(self, parts: Sequence[Part]) -> bool:
        return len(parts) <= self.max_rows and sum(p.tokens for p in parts) <= self.token_budget

    def _pack(self, parts: Sequence[Part]) -> list[list[Part]]:
        """Parts end to end in calls of at most ``token_budget`` tokens and ``max_rows`` parts."""
        calls: list[list[Part]] = []
        for p in parts:
            if not calls or not self._fits([*calls[-1], p]):
                calls.append([])
            calls[-1].append(p)
        return calls

    def _rides(self, parts: Sequence[Part], riders: Sequence[Part]) -> bool:
        """Whether ``riders`` join the packed call of ``parts`` on the bucket it takes anyway."""
        both = [*parts, *riders]
        return self._fits(both) and self._bucket(both) == self._bucket(parts)

    def _bucket(self, parts: Sequence[Part]) -> Bucket | None:
        """The smallest token bucket that holds the parts' tokens and rows, if any does."""
        tokens = sum(p.tokens for p in parts)
        fit = [b for b in self.prefill if b.seq >= tokens and b.batch >= len(parts)]
        return min(fit, key=lambda b: (b.seq, b.batch), default=None)

    def _call(self, parts: Sequence[Part]) -> Call:
        """A packed call on the smallest token bucket that holds its parts' tokens and rows."""
        if (bucket := self._bucket(parts)) is None:
            tokens = sum(p.tokens for p in parts)
            raise NoBucketFits(f"no prefill bucket holds {len(parts)} segments of {tokens} tokens")
        return Call(bucket, tuple(parts))

    def _group_decode(self, plan: Sequence[Segment], indices: Sequence[int]) -> list[Call]:
        """Rows sorted by the context they reach, in calls as wide as the widest decode bucket."""
        if not indices:
            return []
        width = max(b.batch for b in self.decode)
        ctxs = sorted({b.ctx for b in self.decode})
        order = sorted(indices, key=lambda i: plan[i].end)
        calls = []
        for lo in range(0, len(order), width):
            rows = order[lo : lo + width]
            ctx = max(plan[i].end for i in rows)
            if ctx > ctxs[-1]:
                raise NoBucketFits(
                    f"a decode row reaching {ctx} tokens exceeds the largest context {ctxs[-1]}"
                )
            fit_ctx = select_bucket(ctxs, ctx)
            batch = select_bucket(sorted(b.batch for b in self.decode if b.ctx == fit_ctx), len(rows))
            bucket = next(b for b in self.decode if b.ctx == fit_ctx and b.batch == batch)
            calls.append(Call(bucket, tuple(Part(i, 0, len(plan[i].token_ids)) for i in rows)))
        return calls
