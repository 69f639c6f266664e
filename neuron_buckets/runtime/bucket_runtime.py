"""Serve step plans from an artifact directory: lay each plan onto buckets, pad, run, unpad.

``BucketRuntime.open`` validates the manifest, checks and loads the weights once, allocates the
one stacked KV cache every graph shares, and loads nothing else: each piece graph is loaded (and
its sha256 checked) on first use, so opening a directory of many buckets costs about nothing.
A step runs its bucket's embed piece, then its layer piece once per layer with that layer's
weights and cache slice (updated in place), then the piece its output head names (``output_head.py``:
the LM head, or an embedding artifact's norm); a packed call with nothing cached runs the bucket's
fresh layer piece instead, where it has one. The graphs and the kernels they call load through
``piece_graphs.py``. A step plan runs as the calls
``BucketSet.calls`` lists for it, the ones ``nb inspect`` counts. It never imports the compiler:
artifacts flow one way, from ``nb compile`` to here.

A tensor-parallel artifact is opened by every rank (``rank_group.py``): each holds its shard of
the weights (``model/tp/``) and its KV heads of the cache, and runs the same calls; rank 0 hands
each plan to the others before it runs it, and gets every rank's logits back from the head piece.
Any other artifact runs as a group of one (``solo_rank.py``), through the same calls.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from itertools import repeat
from pathlib import Path

import torch
from torch import Tensor

from neuron_buckets.artifact.manifest import BucketRecord, Manifest, read_manifest
from neuron_buckets.backends import get_backend
from neuron_buckets.core.bucket import Bucket, NoBucketFits
from neuron_buckets.core.padding import PaddedCall
from neuron_buckets.core.step_plan import Segment, StepPlan
from neuron_buckets.kernels.libraries import BF16_LINEAR, cpu_attention
from neuron_buckets.model import linear
from neuron_buckets.model.checkpoint import load_weights
from neuron_buckets.model.tp.rank_weights import rank_tensors
from neuron_buckets.model.tp.tensor_parallel import TensorParallel
from neuron_buckets.model.weights import ModelWeights
from neuron_buckets.runtime.artifact_check import ArtifactError, check_servable
from neuron_buckets.runtime.bucket_set import BucketSet, Call
from neuron_buckets.runtime.bucket_stats import BucketStats
from neuron_buckets.runtime.lora_slots import LoraSlots, open_slots
from neuron_buckets.runtime.output_head import output_head
from neuron_buckets.runtime.piece_graphs import PieceGraphs
from neuron_buckets.runtime.prefill_chunk import PrefillChunk
from neuron_buckets.runtime.solo_rank import join_ranks
from neuron_buckets.runtime.step_check import StepLimits, check_step
from neuron_buckets.utils.files import intact
from neuron_buckets.utils.passing_thread import on_passing_thread


def _ranks_stay_in_step(run: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A call runs inside its ranks' step: where they fail it, the group is lost (``in_step``)."""
    @functools.wraps(run)
    def guarded(self: BucketRuntime, *args: object) -> Tensor:
        with self.ranks.in_step():
            return run(self, *args)

    return guarded


def _buckets(directory: Path, manifest: Manifest, mix_decode: bool,
             prefill_only: bool) -> tuple[dict[Bucket, BucketRecord], BucketSet]:
    """The records of ``manifest``'s compiled buckets, and the set a plan is laid onto."""
    records = {r.bucket: r for r in manifest.buckets if r.status == "ok"}
    try:
        return records, BucketSet.of(records, mix_decode, prefill_only)
    except ValueError as e:
        raise ArtifactError(f"{directory}: {e}") from None


class BucketRuntime:
    def __init__(self, directory: Path, manifest: Manifest, device: str) -> None:
        self.directory, self.manifest, self.device = Path(directory), manifest, device
        self.backend = get_backend(manifest.backend.name)
        self.config = check_servable(manifest, self.directory, device, self.backend.dynamic_shapes)
        self.graphs = PieceGraphs(self.directory, manifest, self.backend, device)
        self.graph = self.graphs.graph
        self.tp = TensorParallel(manifest.parallel.tensor_parallel_size)
        self.ranks = join_ranks(self.directory, self.tp.size)
        self.vocab_start = self.tp.vocab_start(self.ranks.rank, self.config.vocab_size)
        self.head = output_head(self.directory, manifest, self.config.vocab_size)
        # packed for nb's bfloat16 kernel only where this artifact's graphs call it
        with linear.bf16_kernel_weights(BF16_LINEAR.name in manifest.libraries):
            weights = self._load_weights(self.ranks.rank)
            head_weights = self.head.weights(*weights.head, self.backend)
        geo = manifest.cache
        self.block_size, self.num_blocks, self.max_model_len = (geo.block_size, geo.num_blocks,
                                                                geo.max_model_len)
        self.k_cache, self.v_cache = (torch.zeros(geo.shape, dtype=getattr(torch, geo.dtype), device=device)
                                      for _ in range(2))
        # Each call's inputs, bound once: per-layer weight tuples and cache slices (views).
        self.embed_weight, self.layer_weights = weights.embed, [layer.tensors() for layer in weights.layers]
        self.head_weights, self.weights = head_weights, weights
        self.layer_caches = list(zip(self.k_cache.unbind(0), self.v_cache.unbind(0), strict=True))
        self.lora: LoraSlots | None = open_slots(manifest, self.config, device)
        self.records, self.buckets = _buckets(self.directory, manifest, cpu_attention(device, geo.dtype),
                                              self.head.prefill_only)
        self.limits = StepLimits(self.block_size, self.num_blocks, self.max_model_len, self.config.vocab_size)
        self.stats = {b.name: BucketStats() for b in self.records}
        self._owner: weakref.ref[object] | None = None

    @property
    def owner(self) -> object | None:
        """The live object that decides which blocks of the KV cache hold what (an engine, by its
        block pool), or None. Two at once would each hand out blocks the other's requests or
        prefix cache still use, so there is one, and the engine enforces it."""
        return None if self._owner is None else self._owner()

    def claim(self, owner: object) -> None:
        """Make ``owner`` the one that decides the KV cache's blocks (held weakly: the runtime
        outlives its engines)."""
        self._owner = weakref.ref(owner)

    @classmethod
    def open(
        cls, path: str | Path, device: str | None = None, preload: bool = False,
        manifest: Manifest | None = None,
    ) -> BucketRuntime:
        """Open an artifact directory (its ``manifest``, if the caller read it already); ``preload``
        loads every graph now instead of on first use (always, for a tensor-parallel artifact's ranks).
        The weights are cast, packed and the cache filled on a passing thread, so the thread that
        opens leaves no OpenMP pool to slow the one that steps (``utils/passing_thread.py``)."""
        def load() -> BucketRuntime:
            read = manifest or read_manifest(Path(path))
            runtime = cls(Path(path), read, device or read.backend.device)
            try:
                if preload or runtime.ranks.preloads:
                    for record in runtime.records.values():
                        for key in record.pieces.values():
                            runtime.graph(key)
                runtime.ranks.loaded()
            except Exception:
                runtime.ranks.abandon()
                raise
            return runtime

        return on_passing_thread(load)

    def _load_weights(self, rank: int) -> ModelWeights:
        """The artifact's weights (``rank``'s shard), fused once as the layer pieces take them, in
        the backend's layout; the file's own tensors are dropped layer by layer, so the model is
        never held twice."""
        info = self.manifest.weights
        path = self.directory / info.file
        if not path.is_file():
            raise ArtifactError(f"weights file {path} is missing")
        if not intact(path, info.sha256):
            raise ArtifactError(f"{path} does not match the manifest's sha256: the weights were changed")
        config, tensors = rank_tensors(path, self.config, rank, self.tp, self.device)
        return load_weights(config, tensors, pack=self.backend.pack)

    def use_manifest(self, manifest: Manifest) -> None:
        """Serve ``manifest``'s buckets from the next call on: another version of this artifact
        (``nb replan``), of the same model, cache geometry, weights and limits, so the KV cache, the
        weights and every graph loaded so far stay as they are (graphs are named by their content).
        Anything else is refused before a thing changes."""
        old = self.manifest
        if (manifest.graph_facts(), manifest.weights, manifest.decode, manifest.libraries) != (
            old.graph_facts(), old.weights, old.decode, old.libraries
        ):
            raise ArtifactError(f"{self.directory}: the new manifest is not of this artifact's model, cache "
                                "geometry, weights and limits; restart the server to serve it")
        records, buckets = _buckets(self.directory, manifest, self.buckets.mix_decode,
                                    self.buckets.prefill_only)
        if buckets.plan_shape != self.buckets.plan_shape:
            raise ArtifactError(f"{self.directory}: the new buckets change the token budget, rows or decode "
                                "width the scheduler plans with; restart the server to serve them")
        self.manifest, self.records, self.buckets = manifest, records, buckets
        self.stats |= {b.name: BucketStats() for b in records if b.name not in self.stats}
        self.graphs.use_manifest(manifest)

    @property
    def loaded(self) -> list[str]:
        """Keys of the piece graphs loaded so far."""
        return self.graphs.loaded

    def record(self, bucket: Bucket) -> BucketRecord:
        rec = self.records.get(bucket)
        if rec is None:
            raise NoBucketFits(f"bucket {bucket.name} is not in {self.directory}")
        return rec

    @torch.inference_mode()
    @_ranks_stay_in_step
    def run(self, bucket: Bucket, step: PaddedCall, lora_slots: Sequence[int] = ()) -> Tensor:
        """Run one padded step through the bucket's pieces; logits of the real samples only, or for
        an embedding artifact the (real tokens, hidden) float32 final-norm hidden states.
        ``lora_slots``: each segment's LoRA slot, for an artifact with slots (none: the base)."""
        pieces = self.record(bucket).pieces
        layer_role = "layer"
        if "fresh_layer" in pieces and step.fresh:
            layer_role, step = "fresh_layer", step.without_context()
        # Every graph of the call loads before the first runs: a damaged one writes nothing.
        embed, layer, out = (self.graph(pieces[role]) for role in ("embed", layer_role, self.head.role))
        input_ids, positions, *state, sampling = (t.to(self.device) for t in step.args())
        h, cos, sin = embed(input_ids - self.vocab_start, positions, self.embed_weight)
        lora = self.lora.inputs(step, lora_slots, self.device) if self.lora else repeat(())
        caches = self.layer_caches
        for weights, (k_cache, v_cache), extra in zip(self.layer_weights, caches, lora, strict=False):
            h = layer(h, cos, sin, *state, k_cache, v_cache, weights, *extra)
        self.stats[bucket.name].add(int((step.slot_mapping >= 0).sum()), bucket.tokens)
        per_call = sampling.numel() if self.backend.dynamic_shapes else self.buckets.samples(bucket)
        return self.head.finish(out, h, step, sampling, self.head_weights, per_call)

    def run_plan(self, plan: StepPlan) -> Tensor:
        """Run a step plan; the logits of each segment's last ``num_samples`` tokens, segment after
        segment: (total samples, vocab). The whole plan is checked before its first call writes
        the cache."""
        self.check_generates()
        check_step(plan, self.limits)
        calls = self.buckets.calls(plan)
        if self.ranks.leads:  # a plan refused above never reaches them
            self.ranks.send(plan)
        samples: dict[int, Tensor] = {}
        for call in calls:
            logits, seq = self._run_call(plan, call), call.bucket.seq
            if call.bucket.kind == "decode":  # a row returns its seq positions, real ones first
                for k, p in enumerate(call.parts):
                    samples[p.segment] = logits[k * seq : k * seq + p.tokens]
                continue
            counts = [self.buckets.part_samples(plan, p) for p in call.parts]
            for p, part_logits in zip(call.parts, logits.split(counts), strict=True):
                if part_logits.numel():
                    samples[p.segment] = part_logits
        empty = torch.empty(0, self.limits.vocab_size)
        return torch.cat([samples[i] for i in sorted(samples)] or [empty])

    def check_generates(self) -> None:
        """Refuse an embedding artifact where logits are wanted: it has no LM head."""
        self.head.check_generates()

    @torch.inference_mode()
    def hidden_states(self, plan: StepPlan) -> list[Tensor]:
        """An embedding artifact's final-norm hidden states of every token of each segment,
        (tokens, hidden) float32, in segment order: what pooling reads. The segments' own
        ``num_samples`` are 0; a segment longer than the largest bucket runs as waves."""
        self.head.check_pools()
        check_step(plan, self.limits)
        parts: list[list[Tensor]] = [[] for _ in plan]
        for call in self.buckets.calls(plan):
            hidden = self._run_call(plan, call)
            for p, h in zip(call.parts, hidden.split([p.tokens for p in call.parts]), strict=True):
                parts[p.segment].append(h)
        return [torch.cat(p) for p in parts]

    def follow(self) -> None:
        """A follower rank: run each plan rank 0 sends, until it ends the group."""
        assert not self.ranks.leads, "only a follower rank follows"
        while (plan := self.ranks.receive()) is not None:
            self.run_plan(plan)

    def close(self) -> None:
        """Rank 0 of a tensor-parallel artifact: end the other ranks (else at exit)."""
        self.ranks.close()

    def _run_call(self, plan: StepPlan, call: Call) -> Tensor:
        """Pad the parts of the plan's segments that ``call`` runs to its bucket, and run it."""
        slots = [plan[p.segment].lora_slot for p in call.parts]
        return self.run(call.bucket, self.buckets.padded(plan, call, self.block_size), slots)

    def prefill(self, chunks: Sequence[PrefillChunk]) -> Tensor:
        """Prefill requests, one chunk each; (R, vocab) logits of each chunk's last token.

        A convenience for scripts: the plan of one segment per chunk, each sampling its last
        token, run as ``run_plan`` runs any plan (packed into as few calls as fit, a prompt longer
        than the largest bucket in waves).
        """
        return self.run_plan(
            tuple(Segment(i, c.token_ids, c.start_pos, c.block_ids, 1) for i, c in enumerate(chunks))
        )


__all__ = ["ArtifactError", "BucketRuntime", "NoBucketFits"]
