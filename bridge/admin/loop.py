"""The admin loop (SPEC §7): every instance reads all partitions of the admin topic — no consumer group shared
with the others — runs each verified command against its own store and replies with its instance id.

A malformed, unsigned, badly signed, stale or replayed record is refused with a reply saying why; nothing about
a record stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from bridge.admin.commands import AdminCommands
from bridge.admin.protocol import (
    Command,
    RedriveArgs,
    Refused,
    reply,
    request_id_of,
    verify,
)
from bridge.admin.redrive import RedriveCommands
from bridge.aio import OneThread
from bridge.config import AdminConfig
from bridge.store.database import StoreError

log = logging.getLogger(__name__)
_CATCH_UP = 1000  # records per admin partition read back at most when the time lookup finds none
_CATCH_UP_S = 30.0  # the read-back is merged in produce order for this long at most; what is left runs as it comes
AUDIT_KEPT_MS = 30 * 86_400_000  # the commands that change something stay in the audit 30 days


class AdminLoop:
    def __init__(self, admin: AdminConfig, commands: AdminCommands, instance_id: str,
                 consumer_factory: Callable[[], Consumer], producer_factory: Callable[[], Producer],
                 now_ms: Callable[[], int]) -> None:
        self.admin = admin
        self.commands = commands
        self.instance_id = instance_id
        self._consumer_factory = consumer_factory
        self._producer_factory = producer_factory
        self._now_ms = now_ms
        self._thread = OneThread("rdq-admin")
        self._producer: Producer | None = None
        self.handled = 0
        self.refused = 0
        self._background: set[asyncio.Task[None]] = set()  # bulk redrives under way
        self._read_back: dict[int, int] = {}  # partition → its end when assigned, where the window read back has any

    @property
    def window_ms(self) -> int:
        return 300_000 if self.admin.auth == "none" else int(self.admin.auth.max_skew * 1000)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._thread.call(fn, *args)

    async def run(self, stop: asyncio.Event) -> None:
        await self.commands.load_settings()
        consumer: Consumer = await self._call(self._consumer_factory)
        self._producer = self._producer_factory()
        try:
            if not await self._assign_when_ready(consumer, stop):
                return
            await self._run_in_order(await self._read_back_window(consumer, stop))
            while not stop.is_set():
                await self._run_in_order(await self._call(consumer.consume, 100, 0.2))
                await asyncio.to_thread(self._producer.poll, 0)
        finally:
            # Bulk redrives under way end at their next batch and send their final reply (what was done, and that
            # the rest stay DEAD) before the producer is flushed.
            self.commands.stopping.set()
            if self._background:
                await asyncio.wait(set(self._background), timeout=10)
            with contextlib.suppress(KafkaException):
                await asyncio.to_thread(self._producer.flush, 5.0)
            await self._call(consumer.close)
            self._thread.shutdown(wait=False)

    async def _run_in_order(self, messages: list[Any]) -> None:
        for msg in messages:
            if msg.error() is None and self._fresh(msg):
                await self.handle(msg.value(), list(msg.headers() or []))

    async def _read_back_window(self, consumer: Consumer, stop: asyncio.Event) -> list[Any]:
        """The last window's commands of every partition (up to each one's end when assigned), merged in the order
        they were produced: Kafka keeps order within a partition only, and a `resume` keyed apart from its `pause`
        (kcat) must not run first here. Each partition's own order is kept (a k-way merge by timestamp)."""
        by_partition: dict[int, list[Any]] = {}
        unread = set(self._read_back)
        deadline = time.monotonic() + _CATCH_UP_S
        while unread and not stop.is_set() and time.monotonic() < deadline:
            for msg in await self._call(consumer.consume, 100, 0.2):
                if msg.error() is None:
                    by_partition.setdefault(msg.partition(), []).append(msg)
            positions = await self._call(consumer.position, [TopicPartition(self.admin.topic, p) for p in unread])
            unread -= {tp.partition for tp in positions if tp.offset >= self._read_back[tp.partition]}
        return list(heapq.merge(*by_partition.values(), key=lambda msg: msg.timestamp()[1]))

    async def _assign_when_ready(self, consumer: Consumer, stop: asyncio.Event) -> bool:
        """Assign the admin topic; while it is missing or the broker is away, say so and try again (a missing
        admin topic must not stop the bridge). False when stopped first."""
        warned = False
        pause = 0.25  # a leader not elected yet on a fresh topic passes in moments; a missing topic may not
        while not stop.is_set():
            try:
                if await self._call(self._assign_all, consumer):
                    return True
                problem = f"admin topic {self.admin.topic!r} does not exist"
            except KafkaException as e:
                problem = f"cannot assign admin topic {self.admin.topic!r}: {e}"
            if not warned:
                log.error("%s; admin commands are not read until it can be (retrying)", problem)
                warned = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
            pause = min(pause * 2, 5.0)
        return False

    def _assign_all(self, consumer: Consumer) -> bool:
        """Every partition, from the records of the last staleness window: commands issued while this instance
        restarted still run (replays are refused by request id). False when the topic has no partitions."""
        topic = self.admin.topic
        metadata = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            return False
        since = self._now_ms() - self.window_ms
        wanted = [TopicPartition(topic, p, since) for p in metadata.partitions]
        offsets = consumer.offsets_for_times(wanted, timeout=30)
        failed = [o for o in offsets if o.error is not None]
        if failed:
            raise KafkaException(failed[0].error)
        # -1 should mean "no command since then", but a broker can answer -1 for records just written (seen on
        # a fresh topic): start at most _CATCH_UP records back instead. Records older than the window are then
        # skipped unanswered by `_fresh` (they would only be refused as stale).
        start, ends = [], {}
        for o in offsets:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, o.partition), timeout=30)
            start.append(o.offset if o.offset >= 0 else max(low, high - _CATCH_UP))
            if high > start[-1]:
                ends[o.partition] = high
        consumer.assign([TopicPartition(topic, o.partition, at) for o, at in zip(offsets, start, strict=True)])
        self._read_back = ends
        return True

    def _fresh(self, msg: Any) -> bool:
        """A record written before the staleness window is history read while catching up: not answered."""
        kind, timestamp = msg.timestamp()
        return bool(kind == 0 or timestamp >= self._now_ms() - self.window_ms)

    async def handle(self, value: bytes | None, headers: list[tuple[str, bytes | None]]) -> None:
        """One admin record → its replies. Never raises: a bad record is refused, the loop goes on. A bulk redrive
        (paced: it may take minutes) runs in the background, so the loop answers other commands meanwhile."""
        request_id = request_id_of(value)
        verified = False
        try:
            cmd = verify(value, headers, self.admin.auth, self._now_ms())
            verified = self.admin.auth != "none"
            args = cmd.args.model_dump(mode="json", exclude_none=True)
            if not await self.commands.store.admin_seen(cmd.request_id, cmd.command, cmd.issued_by, self._now_ms(),
                                                        cmd.key_id, args):
                raise Refused("Replayed", f"request_id {cmd.request_id!r} was already received", verified)
        except Refused as e:
            await self._refuse(request_id, e, verified)
            return
        except StoreError as e:
            await self._send(request_id, error=Refused("StoreUnavailable", str(e), verified))
            return
        log.info("admin %s by %s, key %s (%s)", cmd.command, cmd.issued_by, cmd.key_id, cmd.request_id)
        if isinstance(cmd.args, RedriveArgs) and RedriveCommands.is_bulk(cmd.args):
            self.commands.redrives.expect(cmd.request_id)  # a cancel in the same poll finds it
            task = asyncio.create_task(self._execute(cmd, verified), name=f"rdq-admin-{cmd.request_id}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            # However the command ended (refused before its redrive began, too), it is no longer cancellable.
            task.add_done_callback(lambda _: self.commands.redrives.ended(cmd.request_id))
        else:
            await self._execute(cmd, verified)

    async def _execute(self, cmd: Command, verified: bool) -> None:
        try:
            result = await self.commands.run(cmd, functools.partial(self._send, cmd.request_id, partial=True))
            await self._send(cmd.request_id, result)
            self.handled += 1
        except Refused as e:
            await self._refuse(cmd.request_id, e, verified)
        except StoreError as e:
            await self._send(cmd.request_id, error=Refused("StoreUnavailable", str(e), verified))
        except Exception as e:  # a bug must not stop the admin loop; the operator is told
            log.exception("admin command failed")
            await self._send(cmd.request_id, error=Refused("Internal", f"{type(e).__name__}: {e}", verified))
        if self.handled % 100 == 0:
            with contextlib.suppress(StoreError):
                now = self._now_ms()
                await self.commands.store.admin_prune(now - 2 * self.window_ms, now - AUDIT_KEPT_MS)

    async def _refuse(self, request_id: str | None, e: Refused, verified: bool) -> None:
        self.refused += 1
        e.verified = e.verified or verified
        log.warning("admin record refused: %s: %s", e.type, e.message)
        await self._send(request_id, error=e)

    async def _send(self, request_id: str | None, result: dict[str, Any] | None = None,
                    error: Refused | None = None, partial: bool = False) -> None:
        assert self._producer is not None
        body = reply(request_id, self.instance_id, result, error, partial,
                     verified=error.verified if error is not None else True)
        key = request_id.encode() if request_id else None
        self._producer.produce(self.admin.reply_topic, value=body, key=key)
        await asyncio.to_thread(self._producer.flush, 10.0)
