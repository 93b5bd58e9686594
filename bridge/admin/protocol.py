"""The admin wire format (SPEC §7.4) and its security (§7.5): any Kafka client can speak it.

Command record value: UTF-8 JSON {"request_id", "command", "args", "issued_at" (RFC 3339 UTC), "issued_by"}.
Headers: `rdq.key_id` (which key) and `rdq.signature` = lowercase hex HMAC-SHA256(key, the exact value bytes).
Reply record (reply topic, key = request_id): {"request_id", "instance", "ok": true, "result": {...}} or
{"request_id", "instance", "ok": false, "error": {"type", "message"}}. Long operations may first send
progress replies: {"request_id", "instance", "ok": true, "partial": true, "result": {"progress": {...}}}.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bridge.clock import parse_rfc3339
from bridge.config import AdminAuth
from bridge.model import Status

KEY_ID = "rdq.key_id"
SIGNATURE = "rdq.signature"
COMMANDS = ("redrive", "get", "list", "purge", "pause", "resume", "set-policy", "stats", "breaker", "import",
            "skip", "cancel", "insights", "audit")
READS = ("get", "list", "stats", "insights", "audit")  # change nothing: kept for replay protection only


class Refused(Exception):
    def __init__(self, kind: str, message: str, verified: bool = False) -> None:
        super().__init__(message)
        self.type = f"rdq.admin.{kind}"
        self.message = message
        # True once the command's signature checked out: only then may a refusal be taken as an answer to the
        # request it names (anyone who can produce to the admin topic can write any request_id).
        self.verified = verified


# ---- command arguments (validated; unknown fields refused) ----------------------------------------------


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_times(args: _Args) -> None:
    for name in ("dead_since", "dead_until", "since"):
        value = getattr(args, name, None)
        if value is not None:
            try:
                parse_rfc3339(value)
            except ValueError as e:
                raise ValueError(f"{name} is not an RFC 3339 time: {value!r}") from e


class DlqRef(_Args):
    topic: str = Field(min_length=1)
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)


# A bulk redrive's pace when the command names none, per instance (SPEC §13; `rdq redrive --rate`): slow enough
# that a downstream just back from an outage is not stampeded by a whole DLQ at once.
DEFAULT_REDRIVE_RATE = 100.0
MAX_REDRIVE_RATE = 100_000.0


class Share(_Args):
    """One instance's part of a bulk redrive: its pace and how many tasks at most."""

    rate: float | None = Field(default=None, gt=0, le=MAX_REDRIVE_RATE)
    limit: int | None = Field(default=None, ge=0, le=100_000)


class RedriveArgs(_Args):
    task_id: str | None = None
    task_ids: list[str] | None = Field(default=None, min_length=1, max_length=1000)  # e.g. a canary
    queue: str | None = None
    dlq: DlqRef | None = None
    error_type: str | None = None
    dead_since: str | None = None
    dead_until: str | None = None
    limit: int = Field(default=100, ge=1, le=100_000)
    exclude: list[str] = Field(default_factory=list, max_length=1000)  # with `queue`: e.g. the canary's tasks
    dry_run: bool = False
    instance: str | None = None  # for `dlq`: which instance re-creates a task no store holds
    # With `queue`: tasks/s on this instance (default DEFAULT_REDRIVE_RATE); `shares` gives each instance its own
    # rate and limit (an instance it does not name redrives nothing).
    rate: float | None = Field(default=None, gt=0, le=MAX_REDRIVE_RATE)
    shares: dict[str, Share] | None = None
    force: bool = False  # pass the loop guard (the queue's max_redrives)

    @model_validator(mode="after")
    def _one_target(self) -> RedriveArgs:
        targets = [t for t in (self.task_id, self.task_ids, self.queue, self.dlq) if t is not None]
        if len(targets) != 1:
            raise ValueError("give exactly one of task_id, task_ids, queue, dlq")
        _check_times(self)
        return self


class GetArgs(_Args):
    task_id: str = Field(min_length=1)


class CancelArgs(_Args):
    """Stop a bulk redrive under way (its request id) at its next batch; what it redrove stays redriven."""

    request_id: str = Field(min_length=1, max_length=200)


class SkipArgs(_Args):
    """A dead head that holds its key (ordering: key, on_dead: hold): let the key's next record run."""

    task_id: str = Field(min_length=1)


class ListArgs(_Args):
    queue: str | None = None
    status: Status | None = None
    error_type: str | None = Field(default=None, min_length=1, max_length=300)  # the dead reason's, as redrive's
    dead_since: str | None = None  # RFC 3339: death time in [dead_since, dead_until)
    dead_until: str | None = None
    key: str | None = Field(default=None, max_length=10_000)  # the record key, as text
    text: str | None = Field(default=None, min_length=1, max_length=300)  # in the dead reason's message, any case
    newest: bool = False  # newest death first (else creation order)
    limit: int = Field(default=50, ge=1, le=1000)

    @model_validator(mode="after")
    def _times(self) -> ListArgs:
        _check_times(self)
        return self


class InsightsArgs(ListArgs):
    """What broke: a filter's tasks (DEAD unless told) by error type, per time bucket, attempts by outcome."""

    status: Status | None = Status.DEAD
    bucket_ms: int = Field(default=3_600_000, ge=1000, le=366 * 86_400_000)


class AuditArgs(_Args):
    """The admin commands this instance received (verified), newest first; reads only when asked."""

    since: str | None = None
    reads: bool = False
    limit: int = Field(default=200, ge=1, le=1000)

    @model_validator(mode="after")
    def _times(self) -> AuditArgs:
        _check_times(self)
        return self


class PurgeArgs(_Args):
    task_id: str | None = None
    queue: str | None = None
    status: Literal["SUCCEEDED", "DEAD"] | None = None
    before: str | None = None
    limit: int = Field(default=10_000, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _one_target(self) -> PurgeArgs:
        if (self.task_id is None) == (self.queue is None):
            raise ValueError("give exactly one of task_id, queue")
        return self


class QueueArgs(_Args):
    queue: str = Field(min_length=1)


class SetPolicyArgs(_Args):
    queue: str = Field(min_length=1)
    # Fields of the queue config to override (max_attempts, backoff, lease, errors, …); null or {} clears.
    policy: dict[str, Any] | None = None


class StatsArgs(_Args):
    # A redrive's request id: where the tasks it moved are now (succeeded, failed, waiting, gone) instead of the
    # counts — how a canary is judged, and `rdq stats --redrive ID` after the fact.
    redrive: str | None = Field(default=None, min_length=1, max_length=200)


class BreakerArgs(_Args):
    queue: str = Field(min_length=1)
    # open: hold the queue as an outage would (until `close`); close: release it (and reset its backoff).
    action: Literal["open", "close", "status"]


IMPORT_RANGE_MAX = 5000  # records of a foreign DLQ one `import` command reads (the CLI sends ranges in turn)


class ImportArgs(_Args):
    """Records [from_offset, to_offset) of one partition of another system's DLQ topic → DEAD tasks of `queue`."""

    topic: str = Field(min_length=1)
    partition: int = Field(ge=0)
    from_offset: int = Field(ge=0)
    to_offset: int = Field(ge=1)
    queue: str = Field(min_length=1)
    error_type: str | None = Field(default=None, min_length=1, max_length=300)  # only records failed with it
    dry_run: bool = False
    instance: str | None = None  # without a changelog: the one instance that imports

    @model_validator(mode="after")
    def _range(self) -> ImportArgs:
        if not 0 < self.to_offset - self.from_offset <= IMPORT_RANGE_MAX:
            raise ValueError(f"to_offset - from_offset must be 1..{IMPORT_RANGE_MAX}")
        return self


ARGS: dict[str, type[_Args]] = {
    "redrive": RedriveArgs, "get": GetArgs, "list": ListArgs, "purge": PurgeArgs, "pause": QueueArgs,
    "resume": QueueArgs, "set-policy": SetPolicyArgs, "stats": StatsArgs, "breaker": BreakerArgs,
    "import": ImportArgs, "skip": SkipArgs, "cancel": CancelArgs, "insights": InsightsArgs, "audit": AuditArgs,
}  # fmt: skip


@dataclass(frozen=True)
class Command:
    request_id: str
    command: str
    args: _Args
    issued_at: int
    issued_by: str | None  # self-asserted by whoever wrote the command
    key_id: str | None = None  # the key whose signature verified (None under `auth: none`)


# ---- signing and verifying ------------------------------------------------------------------------------


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def sign(key: bytes | str, value: bytes) -> str:
    return hmac.new(key.encode("utf-8") if isinstance(key, str) else key, value, hashlib.sha256).hexdigest()


# The key of every command record rdq sends (the CLI, the console): one partition, so every instance runs them in
# the order they were sent. Kafka keeps order within a partition only, and an instance catching up after a restart
# reads the last window of every partition: a `resume` keyed apart from its `pause` could run first there and leave
# the queue paused, a cancel could be read before its redrive. A client of one's own (kcat) keys its commands alike.
COMMAND_KEY = b"rdq.admin"


def encode_command(command: str, args: dict[str, Any], issued_by: str, auth: AdminAuth | Literal["none"],
                   request_id: str | None = None, key_id: str | None = None,
                   issued_at: str | None = None) -> tuple[str, bytes, list[tuple[str, bytes]]]:
    """(request_id, value, headers) of a signed command record."""
    request_id = request_id or str(uuid.uuid4())
    value = json.dumps({"request_id": request_id, "command": command, "args": args,
                        "issued_at": issued_at or now_rfc3339(), "issued_by": issued_by},
                       separators=(",", ":")).encode("utf-8")
    headers: list[tuple[str, bytes]] = []
    if auth != "none":
        key_id = key_id or auth.signing_key or next(iter(auth.keys))
        key = auth.key(key_id)
        if key is None:
            raise KeyError(f"no admin key {key_id!r}")
        headers = [(KEY_ID, key_id.encode()), (SIGNATURE, sign(key, value).encode())]
    return request_id, value, headers


def _header(headers: list[tuple[str, bytes | None]], name: str) -> str | None:
    for key, value in headers:
        if key == name and value is not None:
            try:
                return value.decode("ascii")
            except UnicodeDecodeError:
                return None
    return None


def request_id_of(value: bytes | None) -> str | None:
    """The request id of a record, if one can be read at all (for replying to what is refused)."""
    try:
        data = json.loads(value or b"")
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return None
    rid = data.get("request_id") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= 200 else None


def verify(value: bytes | None, headers: list[tuple[str, bytes | None]], auth: AdminAuth | Literal["none"],
           now_ms: int) -> Command:
    """Parse and authenticate a command record, or raise Refused saying why. Replays are checked by the caller."""
    if not value:
        raise Refused("Malformed", "empty command record")
    if auth != "none":
        key_id, signature = _header(headers, KEY_ID), _header(headers, SIGNATURE)
        if not key_id or not signature:
            raise Refused("Unsigned", f"missing {KEY_ID} or {SIGNATURE} header")
        key = auth.key(key_id)
        if key is None:
            raise Refused("UnknownKey", f"no key {key_id!r} is configured")
        if not hmac.compare_digest(sign(key, value), signature.lower()):
            raise Refused("BadSignature", f"signature does not match the value for key {key_id!r}")
    try:
        return _parse(value, headers, auth, now_ms)
    except Refused as e:
        e.verified = auth != "none"  # past the signature: the request_id in the value is the signer's
        raise


def _parse(value: bytes, headers: list[tuple[str, bytes | None]], auth: AdminAuth | Literal["none"],
           now_ms: int) -> Command:
    try:
        data = json.loads(value)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused("Malformed", f"value is not UTF-8 JSON: {e}") from e
    except RecursionError as e:
        raise Refused("Malformed", "value is nested too deeply") from e
    if not isinstance(data, dict):
        raise Refused("Malformed", "value must be a JSON object")
    request_id, name = data.get("request_id"), data.get("command")
    if not isinstance(request_id, str) or not request_id or len(request_id) > 200:
        raise Refused("Malformed", "request_id must be a non-empty string")
    if not isinstance(name, str):
        raise Refused("Malformed", "command must be a string")
    if name not in ARGS:
        raise Refused("UnknownCommand", f"unknown command {name!r}; known: {', '.join(COMMANDS)}")
    issued_at = _issued_at(data.get("issued_at"))
    window = 300_000 if auth == "none" else int(auth.max_skew * 1000)
    if abs(now_ms - issued_at) > window:
        raise Refused("Stale", f"issued_at is {abs(now_ms - issued_at) / 1000:.0f}s from now (window "
                               f"{window / 1000:.0f}s)")
    try:
        args = ARGS[name].model_validate(data.get("args") or {})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'args'}: {x['msg']}" for x in e.errors())
        raise Refused("InvalidArgs", problems) from e
    issued_by = data.get("issued_by")
    return Command(request_id, name, args, issued_at, issued_by[:200] if isinstance(issued_by, str) else None,
                   None if auth == "none" else _header(headers, KEY_ID))


def _issued_at(value: Any) -> int:
    if not isinstance(value, str):
        raise Refused("Malformed", "issued_at must be an RFC 3339 UTC time")
    try:
        parsed = parse_rfc3339(value)
    except ValueError as e:
        raise Refused("Malformed", f"issued_at is not an RFC 3339 time: {value!r}") from e
    assert parsed is not None
    return parsed


def reply(request_id: str | None, instance: str, result: dict[str, Any] | None = None,
          error: Refused | None = None, partial: bool = False, verified: bool = True) -> bytes:
    """`verified`: the command was signed with a configured key. A refusal of an unverified record says so, and a
    client must not take it for an answer to its own request (its request_id may be forged)."""
    body: dict[str, Any] = {"request_id": request_id, "instance": instance, "ok": error is None,
                            "verified": verified}
    if error is not None:
        body["error"] = {"type": error.type, "message": error.message}
    else:
        body["result"] = result or {}
        if partial:
            body["partial"] = True
    return json.dumps(body, separators=(",", ":"), default=str).encode("utf-8")
