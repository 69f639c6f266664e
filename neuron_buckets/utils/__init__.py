"""Small helpers every stage may use (user errors, strict integer parsing, the cache directory).
No graph depends on them, so they are not in any piece's cache key."""
