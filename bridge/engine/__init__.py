"""The retry engine, independent of Kafka: the scheduler under leases, one attempt and its outcome, the periodic
sweep, the circuit breaker, classification and backoff, per-queue handler threads."""
