"""What a first delivery's record is on its way (`Begun`) and what it became (`Ran`, a lane's `Results`, a
failure's `Stored` task); `Plan`, what a chunk's records share (first_delivery.py, runners.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bridge.config import QueueConfig
from bridge.handler_api import HandlerContext
from bridge.model import NewTask, Outcome, Status
from bridge.records import Fetched, SourceRecord, TaskHeaders, source_record
from bridge.registry import Handler


@dataclass(frozen=True)
class Stored:
    """A first delivery's failure, stored: the task's status and id (the id the changelog is awaited on)."""

    status: Status
    task_id: str


@dataclass(slots=True)
class Begun:
    """A record whose handler is about to run: its context and when it began (for the watchdog). A chunk's record
    on the common path is the fetched one, its start by the wall clock read only if it fails (`started_ms` None);
    every other is a SourceRecord."""

    record: SourceRecord | Fetched
    queue_name: str
    queue: QueueConfig
    handler: Handler
    ctx: HandlerContext
    started_ms: int | None
    began: float  # time.monotonic()
    sampled: bool  # traced (tracing on and the sampler says so): spans are built only then
    seconds: float = 0.0  # how long its handler ran, once it returned (a chunk's success: runners.py)

    @property
    def planned(self) -> bool:
        """Begun as fetched (`FirstDelivery.begin`, a planned record of the common path): no SourceRecord yet."""
        return self.started_ms is None

    def source_record(self) -> SourceRecord:
        """Its record as a SourceRecord (it failed, or is traced): made once, shared with its task's headers."""
        headers = self.ctx.headers
        return headers.record() if isinstance(headers, TaskHeaders) else source_record(self.record)

    def overdue(self, now: float) -> str | None:
        """Why its handler must be abandoned now: "silent" (no heartbeat for a whole lease: hung) or "timeout"
        (heartbeating past the queue timeout, the whole-life bound, SPEC 4.6); None: let it run."""
        timeout = self.queue.queue_timeout
        if timeout is not None and now - self.began >= timeout:
            return "timeout"
        if now - self.ctx.last_beat >= self.queue.lease:
            return "silent"
        return None


@dataclass(slots=True)
class Ran:
    """A first delivery's end: `task` is what the record becomes (None: it succeeded); `outcome` and `seconds`
    of its handler, when one ran (the attempt metrics are counted by the batch, on the loop)."""

    record: SourceRecord
    queue_name: str
    task: NewTask | None
    outcome: Outcome | None = None
    seconds: float = 0.0


@dataclass(slots=True)
class Results:
    """A lane's records that ended since the loop last took them. The common end, a success of a chunk's record,
    is a pair (its fetched record, its handler's seconds), not an object of its own; every other end is a `Ran`."""

    ran: list[Ran] = field(default_factory=list)
    ok: list[tuple[Fetched, float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ran) + len(self.ok)

    @property
    def ok_seconds(self) -> list[float]:
        return [seconds for _, seconds in self.ok]

    def done_offsets(self) -> list[int]:
        """The records done now: every success (a failure is done once its task is stored)."""
        return [record.offset() for record, _ in self.ok] + [ran.record.offset for ran in self.ran if ran.task is None]

    def failures(self) -> list[Ran]:
        return [ran for ran in self.ran if ran.task is not None]


@dataclass(frozen=True, slots=True)
class Plan:
    """What every record of a chunk shares on the common path (a sync handler registered here, tracing off):
    looked up once a chunk, not once a record."""

    queue_name: str
    queue: QueueConfig
    handler: Handler
