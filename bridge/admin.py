"""The admin loop (SPEC §7): every instance reads all partitions of the admin topic — no consumer group shared
with the others — runs each verified command against its own store and replies with its instance id.

A malformed, unsigned, badly signed, stale or replayed record is refused with a reply saying why; nothing about
a record stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from bridge.admin_protocol import (
    BreakerArgs,
    Command,
    GetArgs,
    ListArgs,
    PurgeArgs,
    QueueArgs,
    RedriveArgs,
    Refused,
    SetPolicyArgs,
    reply,
    request_id_of,
    verify,
)
from bridge.config import AdminConfig, ConfigError
from bridge.dlq import SCHEMA
from bridge.engine import Engine
from bridge.model import Attempt, Status, Task, parse_rfc3339
from bridge.records import SOURCE, parse_source, source_key
from bridge.store import StoreError

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
                 partitions: Callable[[str], int | None] | None = None) -> None:
        self.engine = engine
        self.store = engine.store
        self.read_record = read_record  # (topic, partition, offset) → value, for redrive from a DLQ record
        self.owns = owns or (lambda topic, partition: False)  # is this source partition assigned here now?
        self.changelog_status = changelog_status
        # With the changelog (SPEC §10): how many partitions a topic has now (None: no such topic), to find the
        # home of a task re-created from its DLQ record. None: tasks are not homed (no changelog).
        self.partitions = partitions

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
            "redrive": self.redrive, "get": self.get, "list": self.list, "purge": self.purge, "pause": self.pause,
            "resume": self.resume, "set-policy": self.set_policy, "stats": self.stats, "breaker": self.breaker,
        }  # fmt: skip
        return await handlers[cmd.command](cmd.args, cmd, progress)

    def _queue(self, name: str) -> str:
        if self.engine.config.queue(name) is None:
            raise Refused("InvalidArgs", f"no queue named {name!r} on this instance")
        return name

    async def redrive(self, args: RedriveArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        by = cmd.issued_by
        if args.task_id is not None:
            return await self._redrive_one(args.task_id, cmd, args.dry_run)
        if args.dlq is not None:
            return await self._redrive_from_dlq(args, cmd)
        assert args.queue is not None
        ids = await self.store.dead_ids(self._queue(args.queue), args.error_type, parse_rfc3339(args.dead_since),
                                        parse_rfc3339(args.dead_until), args.limit)
        if args.dry_run:
            return {"dry_run": True, "matched": ids, "count": len(ids)}
        done: list[str] = []
        for start in range(0, len(ids), _PROGRESS_EVERY):
            chunk = ids[start : start + _PROGRESS_EVERY]
            done += await self.engine.redrive_many(chunk, by, cmd.request_id, cmd.key_id)
            if len(ids) > _PROGRESS_EVERY:
                await progress({"progress": {"done": start + len(chunk), "total": len(ids)}})
        return {"dry_run": False, "redriven": done, "count": len(done), "matched": len(ids)}

    async def _redrive_one(self, task_id: str, cmd: Command, dry_run: bool) -> dict[str, Any]:
        task = await self.store.get(task_id)
        if task is None:
            return {"held": False, "redriven": [], "count": 0}
        if task.status != Status.DEAD:
            return {"held": True, "redriven": [], "count": 0, "status": task.status.value,
                    "note": "only a DEAD task can be redriven"}
        if dry_run:
            return {"held": True, "dry_run": True, "matched": [task_id], "count": 1}
        ok = await self.engine.redrive(task_id, cmd.issued_by, cmd.request_id, cmd.key_id)
        return {"held": True, "redriven": [task_id] if ok else [], "count": int(ok)}

    async def _redrive_from_dlq(self, args: RedriveArgs, cmd: Command) -> dict[str, Any]:
        """Exactly one instance carries it out; every other one refuses, saying why (never `ok` with nothing done).

        With `args.instance`: that instance (it redrives the task if its store has it, else re-creates it from
        the envelope). Without: the instance whose store has it, and, when it is nowhere, the one that consumes
        the task's home partition (`rdq.source`) now. A store holding the task on an instance that no longer owns
        its partition, while the owner re-creates it, would run it twice: `rdq redrive --from-dlq` avoids that
        by asking first who holds it, then naming one instance."""
        assert args.dlq is not None
        ref = args.dlq
        me = self.engine.instance_id
        if args.instance is not None and args.instance != me:
            raise Refused("NotChosen", f"args.instance names {args.instance!r}; this is {me!r}")
        value = await asyncio.to_thread(self.read_record, ref.topic, ref.partition, ref.offset)
        if value is None:
            raise Refused("NotFound", f"no record at {ref.topic}/{ref.partition}/{ref.offset}")
        task = self._envelope_task(value)
        if self.partitions is not None:
            return await self._redrive_at_home(task, args, cmd)
        if await self.store.get(task.id) is not None:
            return {"task_id": task.id, **await self._redrive_one(task.id, cmd, args.dry_run)}
        if args.instance is None:
            home = parse_source(task.headers.get(SOURCE))
            if home is None or not self.owns(home[0], home[1]):
                where = f"its home partition {home[0]}/{home[1]}" if home else "it has no rdq.source, so no home"
                raise Refused("NotHeld", f"task {task.id} is not in the store of {me!r}, and {where} is not "
                                         "consumed here; name an instance (args.instance) to re-create it")
        if args.dry_run:
            return {"task_id": task.id, "held": False, "dry_run": True, "matched": [task.id], "count": 1,
                    "would_recreate": True}
        await self.store.recreate_dead(task, ref.topic, ref.partition, ref.offset)
        ok = await self.engine.redrive(task.id, cmd.issued_by, cmd.request_id, cmd.key_id)
        return {"task_id": task.id, "held": False, "recreated": True, "redriven": [task.id] if ok else [],
                "count": int(ok)}

    async def _redrive_at_home(self, task: Task, args: RedriveArgs, cmd: Command) -> dict[str, Any]:
        """With the changelog, a task lives where its home partition is owned: that instance (exactly one) redrives
        it, re-creating it from the envelope when its changelog no longer holds it (purged)."""
        assert args.dlq is not None
        home = await asyncio.to_thread(self._home_for, task)
        if home is None:
            raise Refused("NotHeld", f"task {task.id} has no home: its queue {task.queue!r} has no source topic here")
        if not self.owns(*home):
            raise Refused("NotOwner", f"task {task.id} lives in partition {home[0]}/{home[1]}, not owned by "
                                      f"{self.engine.instance_id!r}; its owner carries it out")
        if await self.store.get(task.id) is not None:
            return {"task_id": task.id, "home": f"{home[0]}/{home[1]}",
                    **await self._redrive_one(task.id, cmd, args.dry_run)}
        if args.dry_run:
            return {"task_id": task.id, "held": False, "dry_run": True, "matched": [task.id], "count": 1,
                    "would_recreate": True, "home": f"{home[0]}/{home[1]}"}
        ref = args.dlq
        await self.store.recreate_dead(task, ref.topic, ref.partition, ref.offset, home)
        ok = await self.engine.redrive(task.id, cmd.issued_by, cmd.request_id, cmd.key_id)
        return {"task_id": task.id, "held": False, "recreated": True, "home": f"{home[0]}/{home[1]}",
                "redriven": [task.id] if ok else [], "count": int(ok)}

    def _home_for(self, task: Task) -> tuple[str, int] | None:
        """The partition of its `rdq.source`; when that partition no longer exists, the one its key chooses in the
        queue's first source topic."""
        assert self.partitions is not None
        source = task.home
        if source is not None and source[1] < (self.partitions(source[0]) or 0):
            return source
        queue = self.engine.config.queue(task.queue)
        topic = queue.sources[0] if queue is not None and queue.sources else None
        count = self.partitions(topic) if topic is not None else None
        if topic is None or not count:
            return None
        key = source_key(task.headers) or task.id.encode()
        return topic, zlib.crc32(key) % count

    @staticmethod
    def _envelope_task(value: bytes) -> Task:
        try:
            envelope = json.loads(value)
            if envelope.get("schema") != SCHEMA:
                raise ValueError(f"schema is {envelope.get('schema')!r}, not {SCHEMA}")
            attempts = tuple(Attempt.from_json(a) for a in envelope.get("attempts", []))
            return Task.from_json(envelope["task"], attempts)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise Refused("InvalidArgs", f"not an rdq DLQ envelope: {type(e).__name__}: {e}") from e

    async def get(self, args: GetArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        task = await self.store.get(args.task_id)
        if task is None:
            return {"task": None}
        if task.status.terminal:
            await self.store.mark_fetched(task.id, self.engine.clock.now_ms())  # retain_from: fetched
        return {"task": {**task.to_json(), "attempts": [a.to_json() for a in task.attempts],
                         "redrives": await self.store.redrives(task.id)}}

    async def list(self, args: ListArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        tasks = await self.store.list_tasks(args.queue, args.status, args.limit)
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

    async def stats(self, args: Any, cmd: Command, progress: Progress) -> dict[str, Any]:
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
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rdq-admin")
        self._producer: Producer | None = None
        self.handled = 0
        self.refused = 0

    @property
    def window_ms(self) -> int:
        return 300_000 if self.admin.auth == "none" else int(self.admin.auth.max_skew * 1000)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

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
        """One admin record → its replies. Never raises: a bad record is refused, the loop goes on."""
        request_id = request_id_of(value)
        verified = False
        try:
            cmd = verify(value, headers, self.admin.auth, self._now_ms())
            verified = self.admin.auth != "none"
            if not await self.commands.store.admin_seen(cmd.request_id, cmd.command, cmd.issued_by, self._now_ms(),
                                                        cmd.key_id):
                raise Refused("Replayed", f"request_id {cmd.request_id!r} was already received", verified)
            log.info("admin %s by %s, key %s (%s)", cmd.command, cmd.issued_by, cmd.key_id, cmd.request_id)
            result = await self.commands.run(cmd, functools.partial(self._send, cmd.request_id, partial=True))
            await self._send(cmd.request_id, result)
            self.handled += 1
        except Refused as e:
            self.refused += 1
            e.verified = e.verified or verified
            log.warning("admin record refused: %s: %s", e.type, e.message)
            await self._send(request_id, error=e)
        except StoreError as e:
            await self._send(request_id, error=Refused("StoreUnavailable", str(e), verified))
        except Exception as e:  # a bug must not stop the admin loop; the operator is told
            log.exception("admin command failed")
            await self._send(request_id, error=Refused("Internal", f"{type(e).__name__}: {e}", verified))
        if self.handled % 100 == 0:
            with contextlib.suppress(StoreError):
                await self.commands.store.admin_prune(self._now_ms() - 2 * self.window_ms)

    async def _send(self, request_id: str | None, result: dict[str, Any] | None = None,
                    error: Refused | None = None, partial: bool = False) -> None:
        assert self._producer is not None
        body = reply(request_id, self.instance_id, result, error, partial,
                     verified=error.verified if error is not None else True)
        key = request_id.encode() if request_id else None
        self._producer.produce(self.admin.reply_topic, value=body, key=key)
        await asyncio.to_thread(self._producer.flush, 10.0)
