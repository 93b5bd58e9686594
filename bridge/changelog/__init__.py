"""Tasks outlive their bridge (SPEC §10): every transition to a compacted changelog topic co-partitioned with its
source topic, in Kafka transactions with the DLQ records and offsets; a partition's tasks restored from it."""
