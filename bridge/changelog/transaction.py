"""One changelog transaction, on the writer's producer thread (SPEC §10): begin, the DLQ records first (their
offsets go into their tasks' "published" records), the changelog records, the source offsets with the group
metadata of this instance's assignment (KIP-447), commit — never unfenced, never for a partition no longer ours,
and a commit that times out resumed, never aborted (librdkafka's rules)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from bridge.changelog.local import Entry, Home

log = logging.getLogger(__name__)
CALL_TIMEOUT = 10.0  # a transaction's offsets and commit calls (librdkafka retries within it)
COMMIT_PATIENCE = 300.0  # a commit resumed this long unacknowledged: the producer is replaced
_COLLATERAL = {KafkaError._MSG_TIMED_OUT, KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT}
Delivered = Callable[[Any, "DeliveredRecord | None"], None]


@dataclass(frozen=True)
class DeliveredRecord:
    """What a DLQ publisher is told once its record's transaction committed (the shape of a Kafka message)."""

    _topic: str
    _partition: int
    _offset: int

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


@dataclass
class DlqItem:
    task_id: str
    home: Home | None
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes | None]]
    on_delivery: Delivered
    delivered: tuple[int, int] | None = None  # (partition, offset) once the broker took it
    error: str | None = None
    collateral: bool = False


@dataclass
class Round:
    dlq: list[DlqItem] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    dlq_entries: list[Entry] = field(default_factory=list)
    offsets: dict[Home, int] = field(default_factory=dict)
    read_ended: float = float("inf")  # its outbox read's end (time.monotonic()): what was written later is not in it
    idle: bool = False  # its read found nothing unlogged, not even a state sent whose mark is not yet seen


class Fenced:
    """What fences a round's writes: the changelog topics, the assignment's group metadata, the partitions this
    instance may write now (None: every home, for tests of the writer alone)."""

    def __init__(self, topics: dict[str, str], group_metadata: Callable[[], Any | None],
                 writable: Callable[[], frozenset[Home]] | None) -> None:
        self.topics = topics
        self._group_metadata = group_metadata
        self._writable = writable

    def begin_and_send_dlq(self, producer: Producer, items: list[DlqItem]) -> None:
        producer.begin_transaction()
        for item in items:
            producer.produce(item.topic, value=item.value, key=item.key, headers=item.headers,  # type: ignore[arg-type]
                             on_delivery=partial(_dlq_report, item))
        if items:
            producer.flush()  # their offsets go into the tasks' "published" changelog records
            failed = [i for i in items if i.error is not None]
            if failed:
                raise KafkaException(KafkaError(KafkaError._FAIL, f"{len(failed)} DLQ records were refused: "
                                                                   f"{failed[0].error}"))

    def send(self, producer: Producer, work: Round, unfenced: bool = False) -> None:
        """The round's changelog records and source offsets into the open transaction; the commit is the caller's
        next call (apart: a send that never returns is abandoned with its producer, and its transaction then
        never commits). `unfenced`: the one-time push of a store from before the changelog (new task ids, no
        offsets)."""
        metadata = None if unfenced else self._group_metadata()
        writable = self._writable() if self._writable is not None else None
        homed = [e for e in [*work.dlq_entries, *work.entries] if e.home[0] in self.topics]
        homes = {e.home for e in homed} | {i.home for i in work.dlq if i.home is not None and i.home[0] in self.topics}
        if homes and not unfenced and (metadata is None or not work.offsets):
            # Never unfenced: without the group metadata of an assignment (and offsets to send with it) nothing
            # proves these partitions are still ours. A DLQ record of a homed task too, even when its changelog
            # record is not in the round.
            raise KafkaException(KafkaError(KafkaError._FENCED, "no current assignment to fence this write"))
        if writable is not None and not unfenced and any(home not in writable for home in homes):
            # A partition lost since this round read its outbox: not one record of this round goes out.
            raise KafkaException(KafkaError(KafkaError._FENCED, "a partition of this round is no longer ours"))
        for entry in homed:  # a task whose topic has no changelog here stays in its file only
            producer.produce(self.topics[entry.home[0]], key=entry.task_id.encode(), value=entry.value,
                                   partition=entry.home[1])
        if work.offsets and metadata is not None:
            offsets = [TopicPartition(t, p, o) for (t, p), o in work.offsets.items()]
            # librdkafka may not return from this past its timeout (confluentinc/librdkafka#5456, open in 2.16:
            # a coordinator request's timeout is never checked; seen after a broker restart): the writer's
            # watchdog abandons the call (bridge/changelog/writer.py).
            producer.send_offsets_to_transaction(offsets, metadata, CALL_TIMEOUT)


def _dlq_report(item: DlqItem, err: Any, msg: Any) -> None:
    if err is not None:
        item.error = str(err)
        # Failed only because another record of its batch was refused: not this record's fault.
        item.collateral = err.code() in _COLLATERAL
    else:
        item.delivered = (msg.partition(), msg.offset())


def commit(producer: Producer) -> None:
    """librdkafka's rules: a commit that times out (or meets another retriable error) goes on in the
    background, and calling `commit_transaction` again resumes it; it is never aborted — the broker may have
    committed it, and its DLQ records would be dead-lettered again (and librdkafka refuses the abort anyway:
    "conflicting commit_transaction API call", every round, for ever). Only an error that requires abort is
    aborted (by the caller); past `COMMIT_PATIENCE` the producer is replaced, whose `init_transactions`
    waits for the old transaction's end."""
    began = time.monotonic()
    while True:
        try:
            producer.commit_transaction(CALL_TIMEOUT)
            return
        except KafkaException as e:
            error = e.args[0] if e.args else None
            if not isinstance(error, KafkaError) or not error.retriable() or error.txn_requires_abort():
                raise
            waited = time.monotonic() - began
            if waited > COMMIT_PATIENCE:
                # Fatal for this producer: replaced, its transaction's outcome is the broker's.
                raise KafkaException(KafkaError(KafkaError._FATAL, f"a commit unacknowledged for {waited:.0f} s: "
                                                                   f"{error}", fatal=True)) from e
            log.warning("changelog commit not acknowledged yet after %.0f s (resumed, not aborted: the broker "
                        "may have committed it): %s", waited, error)
