"""The graph contract: block tables and slot mapping, masks, step padding (`PaddedCall`) and
buckets. Compiled pieces depend on this code, so it is hashed into every piece's cache key; it
imports no other stage."""
