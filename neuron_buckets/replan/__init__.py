"""``nb replan``: re-plan an artifact's token buckets on the traffic it served, compile only the
pieces the new set lacks, and write the result as a new manifest version beside the old."""
