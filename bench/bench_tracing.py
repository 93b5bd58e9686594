"""The cost of tracing on the per-record path: first deliveries per second with tracing off and on.

    python -m bench.bench_tracing [--n 50000]

Off: no tracer provider at all (the default, `telemetry.tracing: none`). On: the SDK with a batch processor
whose exporter drops the spans (the cost of making spans, not of shipping them). Same records, same process.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from bench.common import record
from bridge.clock import SystemClock
from bridge.config import parse_config
from bridge.handler_api import HandlerContext
from bridge.live_config import LiveConfig
from bridge.records import SourceRecord
from bridge.registry import Registry
from bridge.source.first_delivery import FirstDelivery
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry


class DropExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def noop(ctx: HandlerContext) -> None:
    return None


async def run(n: int, telemetry: Telemetry, store: Store) -> float:
    registry = Registry()
    registry.register("ok", noop)
    config = parse_config({"kafka": {"bootstrap_servers": "x:1"}, "queues": {"q": {"handler": "ok",
                           "sources": ["t"]}}, "engine": {"handler_modules": []}})
    delivery = FirstDelivery(store, LiveConfig(config), registry, SystemClock(), None, "bench", telemetry=telemetry)
    records = [SourceRecord("t", i % 6, i, b"key", b"x" * 1024, 1_800_000_000_000,
                            (("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),))
               for i in range(n)]
    began = time.perf_counter()
    for start in range(0, n, 500):  # a consumer batch at a time, handled concurrently as the consumer does
        await asyncio.gather(*(delivery.handle(r, "q") for r in records[start : start + 500]))
    return n / (time.perf_counter() - began)


def sdk_alone(provider: TracerProvider, n: int, spans: int) -> float:
    """The SDK's own cost, no bridge code: per record, the bridge's consume span (9 attributes) and, for two, the
    attempt span under it (4 attributes, one set at its end). Microseconds per record."""
    tracer = provider.get_tracer("floor")
    consume = {"messaging.system": "kafka", "messaging.operation.type": "process",
               "messaging.operation.name": "process", "messaging.destination.name": "t",
               "messaging.destination.partition.id": "0", "messaging.kafka.offset": 1,
               "messaging.consumer.group.name": "g", "rdq.queue": "q", "messaging.kafka.message.key": "k"}
    attempt = {"rdq.queue": "q", "rdq.attempt": 1, "rdq.source": "kafka://t/0/1"}
    began = time.perf_counter()
    for _ in range(n):
        with tracer.start_as_current_span("process t", kind=SpanKind.CONSUMER, attributes=consume):
            if spans == 2:
                with tracer.start_as_current_span("attempt q", attributes=attempt) as span:
                    span.set_attribute("rdq.outcome", "SUCCESS")
    return (time.perf_counter() - began) / n * 1e6


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        store = await Store.open(Path(tmp) / "t.db")
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(DropExporter(), max_queue_size=100_000))
        await run(2000, Telemetry(), store)  # warm up
        off = await run(n, Telemetry(), store)
        on = await run(n, Telemetry(provider=provider), store)
        off_again = await run(n, Telemetry(), store)
        floor_two, floor_one = sdk_alone(provider, n, 2), sdk_alone(provider, n, 1)
        provider.shutdown()
        await store.close()
    baseline = (off + off_again) / 2
    record("tracing cost on the first-delivery path (ok handler, 1 KB records)", [
        f"records: {n} per run, handled 500 at a time",
        f"tracing off (mean of two runs): {baseline:9.0f} records/s  ({off:.0f}, {off_again:.0f})",
        f"tracing on (SDK, spans dropped): {on:9.0f} records/s",
        f"ratio on / off: {on / baseline:.2f}; cost per record: {(1 / on - 1 / baseline) * 1e6:.1f} µs "
        "(two spans: consume + attempt)",
        f"the SDK alone, the same spans and attributes, no bridge code: {floor_two:.1f} µs per record for the two; "
        f"{floor_one:.1f} µs for the consume span alone",
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=50_000)
    asyncio.run(main(parser.parse_args().n))
