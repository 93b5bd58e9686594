"""The admin loop (SPEC §7): every instance reads all partitions of the admin topic — no consumer group shared
with the others — runs each verified command against its own store and replies with its instance id.

A malformed, unsigned, badly signed, stale or replayed record is refused with a reply saying why; nothing about
a record stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from bridge.admin.imports import ImportCommands, ReadRange
from bridge.admin.protocol import (
    BreakerArgs,
    CancelArgs,
    Command,
    GetArgs,
    ListArgs,
    PurgeArgs,
    QueueArgs,
    RedriveArgs,
    Refused,
    SetPolicyArgs,
    SkipArgs,
    StatsArgs,
    reply,
    request_id_of,
    verify,
)
from bridge.admin.redrive import RedriveCommands
from bridge.aio import OneThread
from bridge.config import AdminConfig, ConfigError
from bridge.engine.core import Engine
from bridge.model import Status, Task, parse_rfc3339
from bridge.store.database import StoreError

log = logging.getLogger(__name__)
Progress = Callable[[dict[str, Any]], Awaitable[None]]
_PROGRESS_EVERY = 500
_CATCH_UP = 1000  # records per admin partition read back at most when the time lookup finds none


def task_summary(task: Task) -> dict[str, Any]:
    data = task.to_json()
    keep = ("id", "queue", "status", "attempt_count", "redrive_count", "next_attempt_at", "created_at", "finished_at")
    summary = {k: data[k] for k in keep}
    summary["error_type"] = task.dead_reason.type if task.dead_reason else None
    summary["source"] = task.source
    return summary


class AdminCommands:
    """What each command does to this instance's store and engine."""

    def __init__(self, engine: Engine, read_record: Callable[[str, int, int], bytes | None],
                 owns: Callable[[str, int], bool] | None = None,
                 changelog_status: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 partitions: Callable[[str], int | None] | None = None, read_range: ReadRange | None = None) -> None:
        self.engine = engine
        self.store = engine.store
        self.changelog_status = changelog_status
        self.stopping = asyncio.Event()  # the bridge is stopping: long commands end early
        self.redrives = RedriveCommands(engine, read_record, owns or (lambda topic, partition: False), partitions,
                                        self.stopping)
        self.imports = ImportCommands(engine, read_range or (lambda topic, partition, start, end: []),
                                      self.redrives)

    async def load_settings(self) -> None:
        """Persisted operator settings (pause, set-policy) apply from the start."""
        for queue, (policy, paused) in (await self.store.queue_settings()).items():
            if paused:
                self.engine.scheduler.paused.add(queue)
            if policy:
                try:
                    self.engine.config.set_override(queue, policy)
                except (ConfigError, ValueError) as e:
                    log.error("stored policy of queue %s no longer applies: %s", queue, e, extra={"queue": queue})

    async def run(self, cmd: Command, progress: Progress) -> dict[str, Any]:
        handlers: dict[str, Callable[[Any, Command, Progress], Awaitable[dict[str, Any]]]] = {
            "redrive": self.redrives.redrive, "get": self.get, "list": self.list, "purge": self.purge,
            "pause": self.pause, "resume": self.resume, "set-policy": self.set_policy, "stats": self.stats,
            "breaker": self.breaker, "import": self.imports.run, "skip": self.skip,
            "cancel": self.cancel,
        }  # fmt: skip
        return await handlers[cmd.command](cmd.args, cmd, progress)

    def _queue(self, name: str) -> str:
        if self.engine.config.queue(name) is None:
            raise Refused("InvalidArgs", f"no queue named {name!r} on this instance")
        return name

    async def get(self, args: GetArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        task = await self.store.get(args.task_id)
        if task is None:
            return {"task": None}
        if task.status.terminal:
            await self.store.mark_fetched(task.id, self.engine.clock.now_ms())  # retain_from: fetched
        ordering = {}
        if task.order_key is not None:  # what it waits behind, what waits behind it (SPEC §12)
            ordering = {"waits_behind": await self.store.order_head(task) if task.status == Status.PARKED else None,
                        "parked_behind": await self.store.parked_behind(task.order_key)}
        return {"task": {**task.to_json(), "attempts": [a.to_json() for a in task.attempts],
                         "redrives": await self.store.redrives(task.id), **ordering}}

    async def cancel(self, args: CancelArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        running = self.redrives.cancel(args.request_id, f"{cmd.issued_by} (key {cmd.key_id or 'none'})")
        return {"request_id": args.request_id, "running": running}

    async def skip(self, args: SkipArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        """Let a held key go (SPEC §12): its dead head stays DEAD (redrive it later if you like); the key's next
        parked record becomes due. Audited with every admin command (who said, which key signed)."""
        task = await self.store.get(args.task_id)
        if task is None:
            return {"task_id": args.task_id, "held": False, "skipped": False}
        key = await self.store.skip(task.id)
        if key is None:
            why = ("its queue has no ordering: key" if task.order_key is None else
                   f"it is {task.status.value}, not a dead task holding its key" if task.status != Status.DEAD else
                   "it does not hold its key (on_dead: release, or skipped already)")
            return {"task_id": task.id, "held": True, "skipped": False, "note": f"cannot skip: {why}"}
        log.info("skip: task %s no longer holds its key (by %s, key %s)", task.id, cmd.issued_by, cmd.key_id,
                 extra={"task_id": task.id, "queue": task.queue})
        self.engine.scheduler.wake(task.queue)
        return {"task_id": task.id, "held": True, "skipped": True, "key": key,
                "parked_behind": await self.store.parked_behind(key)}

    async def list(self, args: ListArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        tasks = await self.store.list_tasks(args.queue, args.status, args.limit, args.error_type)
        return {"tasks": [task_summary(t) for t in tasks]}

    async def purge(self, args: PurgeArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        if args.task_id is not None:
            return {"purged": int(await self.store.purge_task(args.task_id))}
        assert args.queue is not None
        status = Status(args.status) if args.status else None
        return {"purged": await self.store.purge_queue(args.queue, status, parse_rfc3339(args.before), args.limit)}

    async def pause(self, args: QueueArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        queue = self._queue(args.queue)
        await self.store.set_paused(queue, True, cmd.issued_by, self.engine.clock.now_ms(), cmd.key_id)
        self.engine.scheduler.paused.add(queue)
        return {"queue": queue, "paused": True}

    async def resume(self, args: QueueArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        queue = self._queue(args.queue)
        await self.store.set_paused(queue, False, cmd.issued_by, self.engine.clock.now_ms(), cmd.key_id)
        self.engine.scheduler.paused.discard(queue)
        self.engine.scheduler.wake(queue)
        return {"queue": queue, "paused": False}

    async def set_policy(self, args: SetPolicyArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        queue = self._queue(args.queue)
        try:  # retry-policy fields only, deep-merged over the file's, validated as the file would be
            effective = self.engine.config.set_override(queue, args.policy)
        except (ConfigError, ValueError) as e:
            raise Refused("InvalidArgs", str(e)) from e
        await self.store.set_policy(queue, args.policy, cmd.issued_by, self.engine.clock.now_ms(), cmd.key_id)
        self.engine.scheduler.wake(queue)  # queued tasks obey it from their next claim
        return {"queue": queue, "policy": self.engine.config.policy_of(effective)}

    async def breaker(self, args: BreakerArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        """An operator's hand on a queue's circuit breaker (SPEC §11). `open` holds the queue until `close`; a
        manual `pause` and the breaker don't fight: the queue runs only when neither holds it."""
        queue = self._queue(args.queue)
        breakers = self.engine.scheduler.breakers
        breaker = breakers.of(queue)
        by = f"{cmd.issued_by or 'an operator'} (key {cmd.key_id or 'none'})"
        if args.action == "open":
            breakers.report(breaker.force_open(by))
        elif args.action == "close":
            breakers.report(breaker.force_close(by))
        return {"queue": queue, "breaker": breaker.status(), "paused": queue in self.engine.scheduler.paused}

    async def stats(self, args: StatsArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        if args.redrive is not None:
            return {"redrive": args.redrive, "outcomes": await self.store.redrive_outcomes(args.redrive)}
        return {"queues": await self.store.counts(), "paused": sorted(self.engine.scheduler.paused),
                "breakers": self.engine.scheduler.breakers.status(),
                "running": self.engine.scheduler.running_count(), "configured": self.engine.config.queue_names(),
                "dlq_stuck": await self.store.dlq_stuck(), "threads_stuck": self.engine.threads.stuck(),
                **({"changelog": await self.changelog_status()} if self.changelog_status else {})}


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
            while not stop.is_set():
                for msg in await self._call(consumer.consume, 100, 0.2):
                    if msg.error() is None and self._fresh(msg):
                        await self.handle(msg.value(), list(msg.headers() or []))
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
        start = []
        for o in offsets:
            if o.offset >= 0:
                start.append(o.offset)
            else:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, o.partition), timeout=30)
                start.append(max(low, high - _CATCH_UP))
        consumer.assign([TopicPartition(topic, o.partition, at) for o, at in zip(offsets, start, strict=True)])
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
            if not await self.commands.store.admin_seen(cmd.request_id, cmd.command, cmd.issued_by, self._now_ms(),
                                                        cmd.key_id):
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
            task.add_done_callback(lambda _: self.commands.redrives.running.discard(cmd.request_id))
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
                await self.commands.store.admin_prune(self._now_ms() - 2 * self.window_ms)

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
