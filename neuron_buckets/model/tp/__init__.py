"""Tensor parallelism, applied to a model as each rank loads it: the rank-local shapes and the
collectives the traced pieces call (``tensor_parallel.py``), the rule that cuts each weight
(``sharding.py``) and the load of one rank's weights (``rank_weights.py``)."""
