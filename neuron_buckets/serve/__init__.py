"""Serving an artifact directory: the bucket runtime, row packing, the scheduler and the engine.
It never imports the compile stage."""
