"""The artifact directory's contract between ``nb compile`` and the runtime: the typed manifest."""
