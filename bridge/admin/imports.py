"""The `import` admin command (SPEC §13): a range of another system's dead-letter topic → DEAD tasks of a queue,
ready to inspect and redrive (`rdq import`; the formats are in `foreign_dlq`).

Which instance keeps a record's task: with the changelog, the owner of the task's home — the record's original
partition when its original topic is one of the queue's sources, else the partition its key chooses in the queue's
first source (every instance reads the range; each keeps its own). Without the changelog, the one instance the
command names. A record that is not importable is refused with the reason; the rest go on. A task already in the
store (the same record imported before) is left as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from bridge.admin.protocol import Command, ImportArgs, Refused
from bridge.admin.redrive import RedriveCommands
from bridge.dlq.foreign import DlqRecord, NotImportable, pointer, to_task
from bridge.engine.core import Engine
from bridge.model import Task, error_type_matches

# (topic, partition, start, end) → the records in [start, end), as confluent-kafka messages
ReadRange = Callable[[str, int, int, int], list[Any]]
_LISTED = 1000


class ImportCommands:
    def __init__(self, engine: Engine, read_range: ReadRange, redrives: RedriveCommands) -> None:
        self.engine = engine
        self.store = engine.store
        self.read_range = read_range
        self.redrives = redrives  # where a task lives: `owns`, `partitions`, `home_by_key`

    async def run(self, args: ImportArgs, cmd: Command, progress: Any) -> dict[str, Any]:
        queue = self.engine.config.queue(args.queue)
        if queue is None:
            raise Refused("InvalidArgs", f"no queue named {args.queue!r} on this instance")
        me = self.engine.instance_id
        homed = self.redrives.partitions is not None
        if not homed and args.instance != me:
            raise Refused("NotChosen", f"without a changelog the command names the instance that imports "
                                       f"(args.instance is {args.instance!r}; this is {me!r})")
        messages = await asyncio.to_thread(self.read_range, args.topic, args.partition, args.from_offset,
                                           args.to_offset)
        out: dict[str, Any] = {"dry_run": args.dry_run, "read": len(messages), "imported": 0, "exists": 0,
                               "elsewhere": 0, "filtered": 0, "formats": {}, "refused": [], "tasks": []}
        for msg in messages:
            record = DlqRecord.from_message(msg)
            try:
                await self._one(record, args, queue.handler, homed, out)
            except Exception as e:  # one record's trouble (its home, the store) never aborts the rest of the range
                out["refused"].append({"offset": record.offset, "reason": f"not imported: {type(e).__name__}: "
                                                                          f"{str(e)[:200]}"})
        out["tasks"] = out["tasks"][:_LISTED]
        return out

    async def _one(self, record: DlqRecord, args: ImportArgs, handler: str, homed: bool,
                   out: dict[str, Any]) -> None:
        try:
            original = await self._original(record)
            kind, task = to_task(record, args.queue, handler, original)
        except NotImportable as e:
            out["refused"].append({"offset": record.offset, "reason": str(e)})
            return
        if args.error_type is not None and not error_type_matches(
                task.dead_reason.type if task.dead_reason else None, args.error_type):
            out["filtered"] += 1
            return
        home = await asyncio.to_thread(self._home_for, task) if homed else None
        if homed and (home is None or not self.redrives.owns(*home)):
            out["elsewhere"] += 1  # its home's owner imports it
            return
        if await self.store.get(task.id) is not None:
            out["exists"] += 1
            return
        if not args.dry_run and not await self.store.recreate_dead(task, record.topic, record.partition,
                                                                   record.offset, self.engine.clock.now_ms(), home):
            out["exists"] += 1
            return
        out["imported"] += 1
        out["formats"][kind] = out["formats"].get(kind, 0) + 1
        out["tasks"].append(task.id)

    async def _original(self, record: DlqRecord) -> DlqRecord | None:
        """A pointer-only share-group record's original, read from its source topic (None: gone, or no pointer)."""
        where = pointer(record)
        if where is None:
            return None
        topic, partition, offset = where
        try:
            found = await asyncio.to_thread(self.read_range, topic, partition, offset, offset + 1)
        except Exception as e:  # KafkaException: no such topic, the broker away
            raise NotImportable(f"its original kafka://{topic}/{partition}/{offset} cannot be read: "
                                f"{str(e)[:200]}") from e
        return DlqRecord.from_message(found[0]) if found and found[0].offset() == offset else None

    def _home_for(self, task: Task) -> tuple[str, int] | None:
        queue = self.engine.config.queue(task.queue)
        source = task.home
        if source is not None and queue is not None and source[0] in queue.sources:
            return self.redrives.home_for(task)
        return self.redrives.home_by_key(task)

