"""Where a task that cannot succeed goes: the DLQ envelope and its publisher (outbox → Kafka), and
the foreign DLQ formats `rdq import` reads (Spring Kafka, Kafka Connect, share groups)."""
