"""``/v1/embeddings`` over an embedding artifact: each request's inputs tokenized and embedded
together (batched into packed prefill calls) on one worker thread, one request at a time.

An embedding artifact has no engine loop: nothing decodes, so a request is one call of the
embedder that returns when its vectors are ready. Requests beyond ``max_open_requests`` waiting
for the thread get 429, as generation requests do.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from neuron_buckets.engine.embedder import Embedder
from neuron_buckets.engine.request_check import RequestError
from neuron_buckets.server.embedding_protocol import EmbeddingRequest, EmbeddingResponse
from neuron_buckets.server.engine_loop import ServerBusy
from neuron_buckets.utils.errors import UserError

# What a server that cannot do what a route asks says, naming why (400).
NOT_EMBEDDING = ('this artifact was compiled for generation: /v1/embeddings needs an embedding artifact '
                 '(nb compile with [model] task = "embed")')
NOT_GENERATION = ('this artifact was compiled for embeddings ([model] task = "embed"): it has no decode '
                  "graphs or LM head, so it serves /v1/embeddings only")


class EmbeddingServer:
    def __init__(self, embedder: Embedder, model_name: str, max_open_requests: int) -> None:
        self.embedder, self.model_name = embedder, model_name
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="nb-embed")
        self.open, self.max_open_requests = 0, max_open_requests
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
        if self.open >= self.max_open_requests:
            limit = self.max_open_requests
            raise ServerBusy(f"the server holds its limit of {limit} open requests; retry later")
        self.open += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, self.compute, body)
        finally:
            self.open -= 1

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
