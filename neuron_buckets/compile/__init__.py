"""``nb compile``: grid -> one graph per bucket in worker processes -> artifact directory."""
