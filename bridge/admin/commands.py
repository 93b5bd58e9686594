"""What each admin command does to this instance's store and engine (SPEC §7): redrive (admin/redrive.py),
import (admin/imports.py), get, list, skip, purge, pause, resume, set-policy, stats, breaker."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bridge.admin.imports import ImportCommands, ReadRange
from bridge.admin.protocol import (
    AuditArgs,
    BreakerArgs,
    CancelArgs,
    Command,
    GetArgs,
    InsightsArgs,
    ListArgs,
    PurgeArgs,
    QueueArgs,
    Refused,
    SetPolicyArgs,
    SkipArgs,
    StatsArgs,
)
from bridge.admin.redrive import RedriveCommands
from bridge.clock import parse_rfc3339, rfc3339
from bridge.config import ConfigError
from bridge.engine.core import Engine
from bridge.model import Status, Task
from bridge.records import source_key
from bridge.store.reads import TaskFilter

log = logging.getLogger(__name__)
Progress = Callable[[dict[str, Any]], Awaitable[None]]



def _audit_args(text: str | None) -> Any:
    """The stored arguments as JSON again; one capped in the audit stays the text it was cut to."""
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def filter_of(args: ListArgs) -> TaskFilter:
    return TaskFilter(args.queue, args.status.value if args.status else None, args.error_type,
                      parse_rfc3339(args.dead_since), parse_rfc3339(args.dead_until), args.key, args.text, args.newest)


def task_summary(task: Task) -> dict[str, Any]:
    data = task.to_json()
    keep = ("id", "queue", "status", "attempt_count", "redrive_count", "next_attempt_at", "created_at", "finished_at")
    summary = {k: data[k] for k in keep}
    summary["error_type"] = task.dead_reason.type if task.dead_reason else None
    summary["error_message"] = task.dead_reason.message[:500] if task.dead_reason else None
    key = source_key(task.headers)
    summary["key"] = None if key is None else key.decode("utf-8", "backslashreplace")[:200]
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
            "cancel": self.cancel, "insights": self.insights, "audit": self.audit,
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
        """Stop the bulk redrive `args.request_id` at its next batch. Not running here (not yet read, or over):
        `armed`, a redrive with that id read later stops before its first batch."""
        running = self.redrives.cancel(args.request_id, f"{cmd.issued_by} (key {cmd.key_id or 'none'})")
        return {"request_id": args.request_id, "running": running, "armed": not running}

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
        tasks = await self.store.filtered(filter_of(args), args.limit)
        return {"tasks": [task_summary(t) for t in tasks]}

    async def insights(self, args: InsightsArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        return await self.store.insights(filter_of(args), args.bucket_ms)

    async def audit(self, args: AuditArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        rows = await self.store.admin_audit(parse_rfc3339(args.since), args.limit, args.reads)
        for row in rows:
            row["seen_at"] = rfc3339(row["seen_at"])
            row["args"] = _audit_args(row["args"])
        return {"requests": rows}

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
