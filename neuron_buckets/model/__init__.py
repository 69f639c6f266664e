"""The decoder over the paged cache (gpt-fast style, one file) and checkpoint loading."""
