"""nb's benchmarks, a package so that they import their shared parts (``results_table``,
``real_models``, ``servers``...) as its modules rather than through ``sys.path``: run one from the
repository's root as ``python -m bench.bench_x``."""
