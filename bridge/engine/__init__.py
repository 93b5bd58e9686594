"""The retry engine, independent of Kafka: the scheduler under leases, the periodic sweep, the
circuit breaker, classification and backoff, and running one handler."""
