"""Draft-model drafts: a second, smaller checkpoint of the same vocabulary, compiled into the
artifact's ``draft/`` sub-artifact, proposes its greedy continuation one token per call.

The draft has its own KV cache in the target's block geometry, indexed by the target's block ids
and tables: no second block pool. It prefills every prompt chunk the target prefills, in the same
step (``follow``), so a prompt block holds the draft's K/V as well as the target's and a request
that shares it by prefix caching shares the draft's too. A target step's drafts then take k
calls of the draft: the first catches the draft up on the tokens it has not computed (the last
token, and after a fully accepted row the last draft as well: then a short continuing chunk),
each further one a 1-token decode row of the previous draft.

The KV cache manager keeps what the draft has computed and kept of each request
(``draft_computed``). It may pass what the target confirmed, so each step starts from
``min(draft_cached, cached)`` (``draft_context``): the accepted drafts' K/V are
kept, and the slots of rejected ones are overwritten by the next catch-up before anything attends
to them (attention reads only the positions before a token). The drafts are argmaxes, a
deterministic proposal, so rejection sampling keeps a sampled request's distribution exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from neuron_buckets.artifact.manifest import MANIFEST
from neuron_buckets.config.draft import DRAFT
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.engine.kv_cache_manager import KVCacheManager
from neuron_buckets.engine.request import Request
from neuron_buckets.runtime.bucket_runtime import ArtifactError, BucketRuntime


@dataclass(frozen=True)
class DraftModelDrafter:
    runtime: BucketRuntime  # the draft's, over the target artifact's draft/ sub-artifact
    kv: KVCacheManager  # the target's: the draft reads its block tables and keeps its count there

    @classmethod
    def open(cls, target: BucketRuntime, kv: KVCacheManager) -> DraftModelDrafter:
        """The draft of ``target``'s artifact, checked against it: the same vocabulary and cache
        geometry (so the target's block ids mean the same slots), decode rows of one token."""
        path = target.directory / DRAFT
        if not (path / MANIFEST).is_file():
            raise ArtifactError(
                f"{path}: no draft model compiled; set [speculative] method = 'draft_model' and "
                "draft_model in the config and run nb compile"
            )
        draft = BucketRuntime.open(path, target.device)
        theirs, ours = target.limits, draft.limits
        if ours.vocab_size != theirs.vocab_size:
            raise ArtifactError(
                f"{path}: the draft model's vocab_size {ours.vocab_size} differs from the target's "
                f"{theirs.vocab_size}"
            )
        geometry = ("block_size", "num_blocks", "max_model_len")
        if any(getattr(ours, g) != getattr(theirs, g) for g in geometry):
            raise ArtifactError(
                f"{path}: the draft's cache ({', '.join(f'{g} {getattr(ours, g)}' for g in geometry)}) "
                "is not the target's; compile both from one config"
            )
        if draft.buckets.decode_seq != 1:
            seq = draft.buckets.decode_seq
            raise ArtifactError(f"{path}: the draft's decode rows carry {seq} tokens, not 1")
        return cls(draft, kv)

    def follow(self, chunks: Sequence[tuple[Request, Segment]]) -> None:
        """Prefill the target step's prompt chunks into the draft's cache, in the same calls."""
        if not chunks:
            return
        self.runtime.run_plan(tuple(
            Segment(s.request_id, s.token_ids, s.context_len, s.block_ids, 0) for _, s in chunks
        ))
        for req, seg in chunks:
            self.kv.draft_computed(req, seg.end)

    def draft(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        """``rooms[i]`` greedy draft tokens for each request, in ``max(rooms)`` batched calls."""
        ctx = [self.kv.draft_context(r) for r in requests]
        feed = [r.token_ids[c:] for r, c in zip(requests, ctx, strict=True)]
        drafts: list[list[int]] = [[] for _ in requests]
        for j in range(max(rooms, default=0)):
            active = [i for i, room in enumerate(rooms) if room > j]
            plan = tuple(
                Segment(requests[i].request_id, feed[i], ctx[i], self.kv.blocks(requests[i]), 1)
                for i in active
            )
            best = self.runtime.run_plan(plan).argmax(dim=-1).tolist()
            for i, token in zip(active, best, strict=True):
                drafts[i].append(token)
                ctx[i] += len(feed[i])
                feed[i] = [token]
        for req, c in zip(requests, ctx, strict=True):
            self.kv.draft_computed(req, c)
        return drafts
