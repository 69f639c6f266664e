"""``/v1/embeddings`` over an embedding artifact (vLLM's ``OpenAIServingEmbedding``): each
request's inputs tokenized and embedded together (batched into packed prefill calls) on one
worker thread, one request at a time.

An embedding artifact has no engine loop: nothing decodes, so a request is one call of the
embedder that returns when its vectors are ready. Requests beyond ``max_open_requests`` waiting
for the thread get 429, as generation requests do.
"""

from __future__ import annotations

import time

from neuron_buckets.engine.embedder import Embedder
from neuron_buckets.engine.request_check import RequestError
from neuron_buckets.server.embedding_protocol import EmbeddingRequest, EmbeddingResponse
from neuron_buckets.server.errors import check_model
from neuron_buckets.server.worker_thread import WorkerThread
from neuron_buckets.utils.errors import UserError


class OpenAIServingEmbedding:
    """The embeddings route's state: the embedder, its worker thread and the requests it holds."""

    def __init__(self, embedder: Embedder, model_name: str, max_open_requests: int) -> None:
        self.embedder, self.model_name = embedder, model_name
        self.worker = WorkerThread("nb-embed", max_open_requests)
        self.created = int(time.time())

    def encode(self, body: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids: a text through the artifact's tokenizer, ids as they are."""
        tokenizer = self.embedder.tokenizer
        ids = []
        for i, item in enumerate(body.inputs()):
            if isinstance(item, str) and tokenizer is None:
                raise UserError("this artifact has no tokenizer: send each input as a list of token ids")
            tokens = tokenizer.encode(item, body.add_special_tokens) if isinstance(item, str) else item
            ids.append(self.embedder.check_input(tokens, f"input {i}"))
        return ids

    def compute(self, body: EmbeddingRequest) -> EmbeddingResponse:
        if body.dimensions is not None and body.dimensions != self.embedder.hidden_size:
            raise RequestError(f"dimensions={body.dimensions} is not supported: this model's embeddings "
                               f"have {self.embedder.hidden_size}")
        ids = self.encode(body)
        vectors = self.embedder.embed(ids)
        return EmbeddingResponse.of(vectors, self.model_name, sum(map(len, ids)), body.encoding_format)

    async def embeddings(self, body: EmbeddingRequest) -> EmbeddingResponse:
        check_model(body.model, self.model_name)
        return await self.worker.run(self.compute, body)

    def close(self) -> None:
        self.worker.close()
