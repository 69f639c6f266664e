"""`nb serve`: the OpenAI-compatible HTTP server over one engine loop, its wire format and metrics."""
