"""The `redrive` admin command (SPEC §7.2, §7.3, §13): by task id, by a list of ids (a canary), by queue with
filters (paced, in the background of the admin loop), or from a DLQ record; every form behind the loop guard.

A bulk redrive runs at a rate (tasks/s, per instance) so a downstream just back from an outage is not stampeded
by a whole DLQ at once; each batch is one store transaction. Its progress goes out as partial replies about once
a second, its final reply says what was redriven, what was refused and why, and where the redriven tasks are now.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from bridge.admin.protocol import DEFAULT_REDRIVE_RATE, Command, RedriveArgs, Refused
from bridge.clock import parse_rfc3339
from bridge.dlq.foreign import NotImportable, decode_envelope
from bridge.engine.core import Engine
from bridge.model import Status, Task
from bridge.records import SOURCE, parse_source, source_key

Progress = Callable[[dict[str, Any]], Awaitable[None]]
_LISTED = 1000  # ids listed in a reply at most (the count is always whole): a reply must fit a Kafka record
_BATCHES_PER_SECOND = 20
# A cancel of a redrive not running here is kept this long (and at most _EARLY_KEPT of them): a command record is
# read in its partition's order only, so a cancel sent right behind its redrive may be read first when a client keys
# the two apart (kcat; rdq's clients key every command alike: protocol.COMMAND_KEY). Three default staleness
# windows: a redrive older than its window is refused anyway.
EARLY_CANCEL_KEPT_S = 900.0
_EARLY_KEPT = 10_000


def loop_guard_refusal(task_id: str, redrive_count: int, max_redrives: int) -> dict[str, Any]:
    return {"id": task_id, "reason": "LoopGuard", "redrive_count": redrive_count,
            "message": f"redriven {redrive_count} times already (the queue's max_redrives is {max_redrives}); "
                       "--force to redrive it anyway"}


class RedriveCommands:
    def __init__(self, engine: Engine, read_record: Callable[[str, int, int], bytes | None],
                 owns: Callable[[str, int], bool], partitions: Callable[[str], int | None] | None,
                 stopping: asyncio.Event) -> None:
        self.engine = engine
        self.store = engine.store
        self.read_record = read_record  # (topic, partition, offset) → value, for redrive from a DLQ record
        self.owns = owns  # is this source partition assigned here now?
        # With the changelog (SPEC §10): how many partitions a topic has now (None: no such topic), to find the
        # home of a task re-created from its DLQ record. None: tasks are not homed (no changelog).
        self.partitions = partitions
        self.stopping = stopping  # set when the bridge stops: a bulk redrive ends early and says so
        self.running: set[str] = set()  # request ids of the bulk redrives under way
        self.cancelled: dict[str, str] = {}  # request id → who cancelled it
        self.early: dict[str, tuple[str, float]] = {}  # cancels read before their redrive: id → (by, kept until)

    def expect(self, request_id: str) -> None:
        """A bulk redrive about to start (in the background): cancellable from now on, before its scan. A cancel
        read before it (`early`) cancels it now: it stops before its first batch."""
        self.running.add(request_id)
        early = self.early.pop(request_id, None)
        if early is not None and early[1] > time.monotonic():
            self.cancelled[request_id] = early[0]

    def ended(self, request_id: str) -> None:
        """However a bulk redrive ended (refused before it began, too): no longer cancellable."""
        self.running.discard(request_id)
        self.cancelled.pop(request_id, None)

    def cancel(self, request_id: str, by: str) -> bool:
        """A bulk redrive under way stops at its next batch. True when one with that id runs here; otherwise the
        cancel is kept (EARLY_CANCEL_KEPT_S) for a redrive with that id read after it."""
        if request_id in self.running:
            self.cancelled[request_id] = by
            return True
        now = time.monotonic()
        self.early = {i: kept for i, kept in self.early.items() if kept[1] > now}
        if len(self.early) < _EARLY_KEPT:
            self.early[request_id] = (by, now + EARLY_CANCEL_KEPT_S)
        return False

    def max_redrives(self, queue: str, force: bool) -> int | None:
        """The loop guard of a queue (None: forced, or no such queue here — a task of an unconfigured queue is
        guarded by the default)."""
        if force:
            return None
        config = self.engine.config.queue(queue)
        return config.max_redrives if config is not None else 5

    @staticmethod
    def is_bulk(args: RedriveArgs) -> bool:
        """A redrive that may take long (paced): run in the background of the admin loop."""
        return args.queue is not None and not args.dry_run

    async def redrive(self, args: RedriveArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        if args.task_id is not None:
            return await self._redrive_one(args.task_id, cmd, args.dry_run, args.force)
        if args.task_ids is not None:
            return await self._redrive_listed(args.task_ids, cmd, args.dry_run, args.force)
        if args.dlq is not None:
            return await self._redrive_from_dlq(args, cmd)
        return await self._redrive_queue(args, cmd, progress)

    # ---- by queue: paced ---------------------------------------------------------------------------------

    async def _redrive_queue(self, args: RedriveArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        if args.dry_run:
            return await self._plan_or_run(args, cmd, progress)
        self.expect(cmd.request_id)  # before the scan: a cancel sent while it plans is not lost
        try:
            return await self._plan_or_run(args, cmd, progress)
        finally:
            self.ended(cmd.request_id)

    async def _plan_or_run(self, args: RedriveArgs, cmd: Command, progress: Progress) -> dict[str, Any]:
        assert args.queue is not None
        if self.engine.config.queue(args.queue) is None:
            raise Refused("InvalidArgs", f"no queue named {args.queue!r} on this instance")
        me = self.engine.instance_id
        share = args.shares.get(me) if args.shares is not None else None
        if args.shares is not None and share is None:
            return {"dry_run": args.dry_run, "count": 0, "matched": 0, "note": "this instance has no share"}
        limit = share.limit if share is not None and share.limit is not None else args.limit
        rate = (share.rate if share is not None else None) or args.rate or DEFAULT_REDRIVE_RATE
        found = await self.store.dead_candidates(args.queue, args.error_type, parse_rfc3339(args.dead_since),
                                                 parse_rfc3339(args.dead_until), limit, args.exclude) if limit else []
        guard = self.max_redrives(args.queue, args.force)
        eligible = [i for i, n in found if guard is None or n < guard]
        refused = [loop_guard_refusal(i, n, guard) for i, n in found if guard is not None and n >= guard]
        told = {"refused": refused[:_LISTED], "refused_count": len(refused)}
        if args.dry_run:
            return {"dry_run": True, "matched": [i for i, _ in found][:_LISTED], "eligible": eligible[:_LISTED],
                    "count": len(eligible), **told}
        began = time.monotonic()
        done, interrupted = await self._paced(eligible, rate, guard, cmd, progress)
        seconds = time.monotonic() - began
        return {"dry_run": False, "redriven": done[:_LISTED], "count": len(done), "matched": len(found), **told,
                "rate": round(len(eligible if not interrupted else done) / seconds, 1) if seconds > 0 else None,
                "seconds": round(seconds, 3), "outcomes": await self.store.redrive_outcomes(cmd.request_id),
                **({"interrupted": interrupted} if interrupted else {})}

    async def _paced(self, ids: list[str], rate: float, guard: int | None, cmd: Command,
                     progress: Progress) -> tuple[list[str], str | None]:
        """Redrive `ids` at `rate` per second: batches of about 1/20 s of work, each batch's end held back to
        where the rate puts it (so the pace holds over any span longer than a batch)."""
        batch = max(1, min(500, round(rate / _BATCHES_PER_SECOND)))
        began = last_report = time.monotonic()
        done: list[str] = []
        for start in range(0, len(ids), batch):
            if self.stopping.is_set():
                return done, "the bridge is stopping: the rest stay DEAD (run the redrive again)"
            if cmd.request_id in self.cancelled:
                return done, f"cancelled by {self.cancelled[cmd.request_id]}: the rest stay DEAD"
            chunk = ids[start : start + batch]
            done += await self.engine.redrive_many(chunk, cmd.issued_by, cmd.request_id, cmd.key_id, guard)
            handled = start + len(chunk)
            wait = began + handled / rate - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), wait)
            now = time.monotonic()
            if now - last_report >= 1.0 and handled < len(ids):
                last_report = now
                await progress({"progress": {"done": handled, "total": len(ids), "redriven": len(done),
                                             "rate": round(handled / (now - began), 1)}})
        return done, None

    # ---- by id -------------------------------------------------------------------------------------------

    async def _redrive_listed(self, ids: list[str], cmd: Command, dry_run: bool, force: bool) -> dict[str, Any]:
        """The tasks of `ids` this store holds (each instance answers for its own); one transaction."""
        held = [t for t in [await self.store.get(i) for i in dict.fromkeys(ids)] if t is not None]
        dead = [t for t in held if t.status == Status.DEAD]
        refused = []
        eligible = []
        for task in dead:
            guard = self.max_redrives(task.queue, force)
            if guard is not None and task.redrive_count >= guard:
                refused.append(loop_guard_refusal(task.id, task.redrive_count, guard))
            else:
                eligible.append(task)
        told = {"held": len(held), "not_dead": len(held) - len(dead), "refused": refused,
                "refused_count": len(refused)}
        if dry_run:
            return {"dry_run": True, "matched": [t.id for t in eligible], "count": len(eligible), **told}
        done: list[str] = []
        for queue in dict.fromkeys(t.queue for t in eligible):  # one guard per queue
            done += await self.engine.redrive_many([t.id for t in eligible if t.queue == queue], cmd.issued_by,
                                                   cmd.request_id, cmd.key_id, self.max_redrives(queue, force))
        return {"dry_run": False, "redriven": done, "count": len(done), **told}

    async def _redrive_one(self, task_id: str, cmd: Command, dry_run: bool, force: bool) -> dict[str, Any]:
        task = await self.store.get(task_id)
        if task is None:
            return {"held": False, "redriven": [], "count": 0}
        if task.status != Status.DEAD:
            return {"held": True, "redriven": [], "count": 0, "status": task.status.value,
                    "note": "only a DEAD task can be redriven"}
        guard = self.max_redrives(task.queue, force)
        if guard is not None and task.redrive_count >= guard:
            refusal = loop_guard_refusal(task_id, task.redrive_count, guard)
            return {"held": True, "redriven": [], "count": 0, "refused": [refusal], "refused_count": 1,
                    "note": refusal["message"]}
        if dry_run:
            return {"held": True, "dry_run": True, "matched": [task_id], "count": 1}
        ok = await self.engine.redrive(task_id, cmd.issued_by, cmd.request_id, cmd.key_id, guard)
        return {"held": True, "redriven": [task_id] if ok else [], "count": int(ok)}

    # ---- from a DLQ record -------------------------------------------------------------------------------

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
        task = envelope_task(value)
        if self.partitions is not None:
            return await self._redrive_at_home(task, args, cmd)
        if await self.store.get(task.id) is not None:
            return {"task_id": task.id, **await self._redrive_one(task.id, cmd, args.dry_run, args.force)}
        if args.instance is None:
            home = parse_source(task.headers.get(SOURCE))
            if home is None or not self.owns(home[0], home[1]):
                where = f"its home partition {home[0]}/{home[1]}" if home else "it has no rdq.source, so no home"
                raise Refused("NotHeld", f"task {task.id} is not in the store of {me!r}, and {where} is not "
                                         "consumed here; name an instance (args.instance) to re-create it")
        return await self._recreate(task, args, cmd, None)

    async def _redrive_at_home(self, task: Task, args: RedriveArgs, cmd: Command) -> dict[str, Any]:
        """With the changelog, a task lives where its home partition is owned: that instance (exactly one) redrives
        it, re-creating it from the envelope when its changelog no longer holds it (purged)."""
        home = await asyncio.to_thread(self.home_for, task)
        if home is None:
            raise Refused("NotHeld", f"task {task.id} has no home: its queue {task.queue!r} has no source topic here")
        if not self.owns(*home):
            raise Refused("NotOwner", f"task {task.id} lives in partition {home[0]}/{home[1]}, not owned by "
                                      f"{self.engine.instance_id!r}; its owner carries it out")
        where = {"home": f"{home[0]}/{home[1]}"}
        if await self.store.get(task.id) is not None:
            return {"task_id": task.id, **where, **await self._redrive_one(task.id, cmd, args.dry_run, args.force)}
        return {**where, **await self._recreate(task, args, cmd, home)}

    async def _recreate(self, task: Task, args: RedriveArgs, cmd: Command,
                        home: tuple[str, int] | None) -> dict[str, Any]:
        assert args.dlq is not None
        guard = self.max_redrives(task.queue, args.force)
        if guard is not None and task.redrive_count >= guard:
            refusal = loop_guard_refusal(task.id, task.redrive_count, guard)
            return {"task_id": task.id, "held": False, "redriven": [], "count": 0, "refused": [refusal],
                    "refused_count": 1, "note": refusal["message"]}
        if args.dry_run:
            return {"task_id": task.id, "held": False, "dry_run": True, "matched": [task.id], "count": 1,
                    "would_recreate": True}
        ref = args.dlq
        await self.store.recreate_dead(task, ref.topic, ref.partition, ref.offset, self.engine.clock.now_ms(), home)
        ok = await self.engine.redrive(task.id, cmd.issued_by, cmd.request_id, cmd.key_id, guard)
        reply = {"task_id": task.id, "held": False, "recreated": True, "redriven": [task.id] if ok else [],
                 "count": int(ok)}
        if not ok:  # another redrive or a purge reached it between the two steps: say so, not a bare 0
            reply["note"] = (f"task {task.id} was re-created DEAD from its DLQ record, but was no longer DEAD when "
                             "its redrive came (redriven or purged meanwhile); `rdq get` shows where it is")
        return reply

    def home_for(self, task: Task) -> tuple[str, int] | None:
        """The partition of its `rdq.source`; when that partition no longer exists, the one its key chooses in the
        queue's first source topic."""
        assert self.partitions is not None
        source = task.home
        if source is not None and source[1] < (self.partitions(source[0]) or 0):
            return source
        return self.home_by_key(task)

    def home_by_key(self, task: Task) -> tuple[str, int] | None:
        """The partition the task's key (or id) chooses in its queue's first source topic."""
        assert self.partitions is not None
        queue = self.engine.config.queue(task.queue)
        topic = queue.sources[0] if queue is not None and queue.sources else None
        count = self.partitions(topic) if topic is not None else None
        if topic is None or not count:
            return None
        key = source_key(task.headers) or task.id.encode()
        return topic, zlib.crc32(key) % count


def envelope_task(value: bytes) -> Task:
    try:
        return decode_envelope(value)
    except NotImportable as e:
        raise Refused("InvalidArgs", str(e)) from e
