"""Block-KV semantics with no model in them: block tables, slot mapping, masks, step padding,
buckets and the block pool. Every other stage builds on these; they import no other stage."""
