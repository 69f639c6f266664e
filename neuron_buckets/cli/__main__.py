"""``python -m neuron_buckets.cli``: the ``nb`` command without its console script."""

from neuron_buckets.cli.main import app

app(prog_name="nb")
