"""`rdq dlq tail --topic T`: a dead-letter topic read for a person (or, `--json`, one object per line for scripts).

Each record: where it is, the task id, queue, why it died, one line per attempt, its source and trace id. This
project's envelope and the foreign formats `rdq import` knows (Spring Kafka, Kafka Connect, share groups) read the
same way; any other record is shown as unreadable, with the reason. Reads from the beginning (`--last N`: the last
N of each partition) to the end, or on (`--follow`) until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Callable
from typing import Any, TextIO

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from bridge.clock import rfc3339
from bridge.config import BridgeConfig, ConfigError
from bridge.dlq.foreign import RDQ, DlqRecord, NotImportable, decode_envelope, to_task
from bridge.kafka_clients import KAFKA_LOG
from bridge.records import TRACEPARENT, trace_id, valid_traceparent


def describe(record: DlqRecord) -> dict[str, Any]:
    """One DLQ record as data: its task (id, queue, reason, attempts, source, trace) or why it cannot be read."""
    where = {"topic": record.topic, "partition": record.partition, "offset": record.offset}
    try:
        kind, task = to_task(record, "?", "?")
    except NotImportable as e:
        return {**where, "unreadable": str(e)}
    if kind == RDQ:  # the envelope's own queue and headers, as published
        task = decode_envelope(record.value or b"")
    # The record's own trace: a foreign record without one would otherwise show the trace made up for its task.
    traceparent = task.headers.get(TRACEPARENT) if kind == RDQ else _header(record, TRACEPARENT)
    return {**where, "format": kind, "task_id": task.id, "queue": task.queue if kind == RDQ else None,
            "reason": task.dead_reason.to_json() if task.dead_reason else None, "source": task.source,
            "trace_id": trace_id(traceparent) if traceparent and valid_traceparent(traceparent) else None,
            "redrive_count": task.redrive_count, "dead_at": rfc3339(task.finished_at),
            "attempts": [_attempt(a) for a in task.attempts]}


def _header(record: DlqRecord, name: str) -> str | None:
    value = next((v for k, v in record.headers if k == name and v is not None), None)
    return value.decode("utf-8", "replace") if value is not None else None


def _attempt(attempt: Any) -> dict[str, Any]:
    return {"attempt_no": attempt.attempt_no, "redrive_no": attempt.redrive_no,
            "finished_at": rfc3339(attempt.finished_at), "outcome": attempt.outcome.value,
            "error": f"{attempt.error.type}: {attempt.error.message}" if attempt.error else None,
            **({"note": attempt.note} if attempt.note else {})}


def for_people(entry: dict[str, Any]) -> str:
    head = f"{entry['topic']}/{entry['partition']}/{entry['offset']}"
    if "unreadable" in entry:
        return f"{head}  unreadable: {entry['unreadable']}"
    reason = entry["reason"] or {}
    lines = [f"{head}  task {entry['task_id']}  queue {entry['queue'] or '-'}  ({entry['format']})",
             f"  dead {entry['dead_at']}: {reason.get('type')}: {reason.get('message')}",
             f"  source {entry['source'] or '-'}  trace {entry['trace_id'] or '-'}  redrives {entry['redrive_count']}"]
    for a in entry["attempts"]:
        note = f"  ({a['note']})" if a.get("note") else ""
        redrive = f" of redrive {a['redrive_no']}" if a["redrive_no"] else ""
        lines.append(f"  attempt {a['attempt_no']}{redrive}  {a['finished_at']}  {a['outcome']}"
                     f"{'  ' + a['error'] if a['error'] else ''}{note}")
    return "\n".join(lines)


def tail(config: BridgeConfig, args: argparse.Namespace, out: TextIO = sys.stdout,
         stop: Callable[[], bool] = lambda: False) -> int:
    consumer = Consumer({"bootstrap.servers": config.kafka.bootstrap_servers, "logger": KAFKA_LOG,
                         "group.id": f"rdq-tail-{uuid.uuid4().hex}", "enable.auto.commit": False,
                         "enable.partition.eof": True, **config.kafka.client})
    try:
        metadata = consumer.list_topics(args.topic, timeout=15).topics.get(args.topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise ConfigError(f"topic {args.topic!r} is not available: {metadata.error if metadata else ''}")
        starts = []
        open_partitions = set()
        for p in sorted(metadata.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(args.topic, p), timeout=15)
            # --last N: twice N back, then the last N records found before the end: with transactions (the DLQ
            # is written in one with the changelog) offsets hold commit markers as well as records.
            start = max(low, high - 2 * args.last) if args.last is not None else OFFSET_BEGINNING
            starts.append(TopicPartition(args.topic, p, start))
            if high > low:
                open_partitions.add(p)
        consumer.assign(starts)
        held: dict[int, list[str]] = {p: [] for p in open_partitions} if args.last is not None else {}
        shown = 0

        def show(text: str) -> None:
            nonlocal shown
            print(text, file=out, flush=True)
            shown += 1

        while (args.follow or open_partitions) and not stop():
            for msg in consumer.consume(100, 0.5):
                error, partition = msg.error(), msg.partition() or 0
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF and partition in open_partitions:
                        open_partitions.discard(partition)
                        kept = held.pop(partition, [])
                        for text in kept[-args.last:] if args.last else []:
                            show(text)
                    continue
                entry = describe(DlqRecord.from_message(msg))
                text = json.dumps(entry) if args.json else for_people(entry)
                if partition in held:
                    held[partition].append(text)
                else:
                    show(text)
        if not args.json and not shown:
            print(f"{args.topic}: no records", file=out)
        return 0
    finally:
        consumer.close()

