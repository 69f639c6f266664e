"""Generation over the runtime: requests, the scheduler and block pool, sampling, the tokenizer
and the streaming detokenizer, and the step-wise `LLMEngine`."""
