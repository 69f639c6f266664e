"""Running an artifact: open and check it, check each step, pick and call the buckets, verify.
It never imports the compile stage."""
