"""What ends a bucket's call: the LM head's logits, or an embedding artifact's hidden states.

The manifest says which once (``output_head``, at open): a generation artifact's buckets end in
the head piece, which returns the logits of the sampled positions; an embedding artifact's end in
its norm piece, the final-norm hidden states of every real token, which pooling reads. The runtime
runs either the same way and asks its head what the call returns, never which head it has.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from neuron_buckets.artifact.manifest import Manifest
from neuron_buckets.backends import Backend, GraphFn
from neuron_buckets.core.padding import PaddedCall
from neuron_buckets.model.weights import ModelWeights
from neuron_buckets.runtime.artifact_check import ArtifactError


@dataclass(frozen=True)
class LogitsHead:
    """The LM head: logits of each call's sampled positions, cut to the vocabulary."""

    directory: Path
    vocab_size: int

    role = "head"  # the piece that ends a call
    prefill_only = False  # decode buckets too

    def weights(self, norm: Tensor, out: Tensor, backend: Backend) -> tuple[Tensor, Tensor]:
        """What the head piece takes: the final norm and the output projection, packed."""
        return norm, backend.pack_head(out)

    def finish(self, graph: GraphFn, h: Tensor, step: PaddedCall, sampling: Tensor,
               weights: tuple[Tensor, Tensor], per_call: int) -> Tensor:
        """The logits of the real samples. One head call returns ``per_call`` samples; a step that
        asks for more (a prompt's logits) runs the same head over each further group of
        positions: no graph of its own."""
        if sampling.numel() <= per_call:
            logits = graph(h, sampling, *weights)
        else:
            logits = torch.cat([graph(h, group, *weights) for group in sampling.split(per_call)])
        return logits[: step.num_samples, : self.vocab_size]  # a vocabulary-parallel head pads

    def check_generates(self) -> None:
        """It generates."""

    def check_pools(self) -> None:
        raise ArtifactError(f"{self.directory} was compiled for generation: it has no norm pieces "
                            "for hidden states; compile it with model.task = \"embed\"")

    def eager_weights(self, weights: ModelWeights) -> ModelWeights:
        """The weights an eager model computes this head's output with: the model's own."""
        return weights

    def sampled(self, out: Tensor, step: PaddedCall) -> Tensor:
        """The rows of ``finish``'s output that the eager model returns: all of them."""
        return out


@dataclass(frozen=True)
class PoolingHead:
    """An embedding artifact's norm piece: the float32 final-norm hidden states of the real tokens."""

    directory: Path

    role = "norm"
    prefill_only = True  # it decodes nothing

    def weights(self, norm: Tensor, out: Tensor, backend: Backend) -> tuple[Tensor, Tensor]:
        """The final norm; no head packed: the norm piece projects nothing."""
        return norm, out

    def finish(self, graph: GraphFn, h: Tensor, step: PaddedCall, sampling: Tensor,
               weights: tuple[Tensor, Tensor], per_call: int) -> Tensor:
        """(real tokens, hidden): real tokens lie at the front of a packed step, in segment order."""
        real = int((step.segment_ids < step.num_rows).sum())
        return graph(h, weights[0])[:real]

    def check_generates(self) -> None:
        raise ArtifactError(f"{self.directory} is an embedding artifact (model.task = \"embed\"): it has "
                            "no LM head or decode graphs, so it cannot generate; compile one without it")

    def check_pools(self) -> None:
        """It pools."""

    def eager_weights(self, weights: ModelWeights) -> ModelWeights:
        """The norm piece is the head with an identity for the output projection."""
        eye = torch.eye(weights.norm.shape[0], dtype=weights.norm.dtype, device=weights.norm.device)
        return replace(weights, lm_head=eye)

    def sampled(self, out: Tensor, step: PaddedCall) -> Tensor:
        """Hidden states of every real token: the sampled ones are what the eager model returns."""
        return out[step.real_sampling_positions]


OutputHead = LogitsHead | PoolingHead


def output_head(directory: Path, manifest: Manifest, vocab_size: int) -> OutputHead:
    """The head ``manifest``'s buckets end in: pooling where it records an embedding."""
    return PoolingHead(directory) if manifest.embedding is not None else LogitsHead(directory, vocab_size)
