"""A real single-node Apache Kafka broker (KRaft) resolved from Maven Central, for tests and `make run`.

No Docker and no Apache tarball needed: Maven resolves `org.apache.kafka:kafka_2.13` and its runtime
dependencies into a cache outside the repository; the broker runs from those jars on 127.0.0.1.
"""

from localkafka.broker import KAFKA_VERSION, BrokerError, LocalBroker, cache_root, resolve_jars

__all__ = ["KAFKA_VERSION", "BrokerError", "LocalBroker", "cache_root", "resolve_jars"]
