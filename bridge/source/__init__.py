"""Where a source record enters: the consumer's poll loop, its per-partition lanes (per-key order),
the first delivery of each record, and which offset may be committed."""
