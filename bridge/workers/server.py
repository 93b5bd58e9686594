"""Remote workers (SPEC §8.2, §4.5): processes in any language claim tasks over a socket.

The protocol (docs/remote-workers.md) is newline-delimited JSON over TCP or a Unix socket: `hello` (token,
handler refs), then `claim`, `heartbeat` and `result` requests, each answered with the request's `id`.
A worker's tasks are held under leases like any other; when its connection drops they are re-queued at once
(a LEASE_EXPIRED attempt, counted against max_attempts), not when the leases lapse. Late results follow §4.5.

Fencing: a worker acts only on what it was given. A lease token on the wire is the store's counter signed with
a key the bridge keeps in its store (`<n>.<mac>`), so it cannot be guessed or made up for a task never claimed;
a heartbeat counts only for a task this connection holds; a result is judged by the token it carries (its own
lease: the outcome; an older lease of this bridge: a late result, SPEC §4.5), and the attempt number and retry
decision come from the store, never from the worker.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from bridge.aio import first_of
from bridge.clock import rfc3339
from bridge.config import WorkersConfig
from bridge.engine.core import Engine
from bridge.engine.policy import decide
from bridge.engine.runner import RunOutcome
from bridge.model import ErrorInfo, Outcome, Task
from bridge.store.database import StoreError

log = logging.getLogger(__name__)
PROTOCOL = 2  # 2: lease tokens are opaque strings (they were integers)
_MAX_LINE = 64 * 1024 * 1024  # after `hello`: payloads travel base64 in JSON
_HELLO_LINE = 8 * 1024  # before: an unauthenticated peer gets a few KB, not 64 MiB of our memory
_MAX_REQUESTS = 64  # requests of one connection in progress at once; past it the bridge stops reading (back-pressure)
_TOKEN_KEY = "worker-lease-tokens"
_OUTCOMES = {"success": Outcome.SUCCESS, "retryable": Outcome.RETRYABLE_FAILURE,
             "permanent": Outcome.PERMANENT_FAILURE}


class ProtocolError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.type = f"rdq.worker.{kind}"


class LeaseTokens:
    """Lease tokens as workers see them: `<n>.<mac>`, n the store's fencing counter for the task, mac an HMAC of
    (task id, n) under the bridge's key. Only this bridge can make one; each names one lease of one task."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, task_id: str, token: int) -> str:
        return hmac.new(self._key, f"{task_id}.{token}".encode(), hashlib.sha256).hexdigest()[:32]

    def issue(self, task_id: str, token: int) -> str:
        return f"{token}.{self._mac(task_id, token)}"

    def verify(self, task_id: str, text: Any) -> int:
        """The counter in a token issued for this task; ProtocolError for anything else."""
        if isinstance(text, str) and text.count(".") == 1:
            number, mac = text.split(".")
            if number.isdigit() and len(number) < 19 and hmac.compare_digest(mac.encode(), self._mac(
                    task_id, int(number)).encode()):
                return int(number)
        raise ProtocolError("BadToken", "not a lease token this bridge issued for this task")


@dataclass
class _Held:
    task: Task
    started_at: int
    expires_at: int  # ms; past it the sweep may reclaim the task and this entry is pruned


@dataclass
class _Connection:
    worker: str
    handlers: set[str]
    queues: list[str]
    held: dict[str, _Held] = field(default_factory=dict)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class WorkerServer:
    def __init__(self, config: WorkersConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.store = engine.store
        self.leases = LeaseTokens(b"")  # the real key is read from the store in run()
        self.requests_in_progress = 0  # across connections; each connection has at most _MAX_REQUESTS
        self.connections: set[asyncio.Task[None]] = set()
        self.bound: list[str] = []  # the addresses actually listened on (tcp port 0 → the real port)

    # ---- serving ---------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.leases = LeaseTokens(await self.store.secret(_TOKEN_KEY, lambda: os.urandom(32)))
        servers = [await self._listen(address) for address in self.config.listen]
        log.info("remote workers: listening on %s", ", ".join(self.bound))
        try:
            await stop.wait()
        finally:
            for server in servers:
                server.close()
            for connection in list(self.connections):
                connection.cancel()
            await asyncio.gather(*self.connections, return_exceptions=True)
            for server in servers:
                await server.wait_closed()

    async def _listen(self, address: str) -> asyncio.Server:
        if address.startswith("unix://"):
            path = address[len("unix://"):]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            # Created 0660 from the start (no window with a world-writable socket, as chmod after bind had). The
            # umask is process-wide: set it only around the bind, on the event loop where nothing else runs.
            previous = os.umask(0o117)
            try:
                server = await asyncio.start_unix_server(self._serve, path=path, limit=_HELLO_LINE)
            finally:
                os.umask(previous)
            self.bound.append(address)
            return server
        host, _, port = address[len("tcp://"):].rpartition(":")
        server = await asyncio.start_server(self._serve, host or "127.0.0.1", int(port), limit=_HELLO_LINE)
        sockname = server.sockets[0].getsockname()
        self.bound.append(f"tcp://{sockname[0]}:{sockname[1]}")
        return server

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        conn: _Connection | None = None
        requests: set[asyncio.Task[None]] = set()
        slots = asyncio.Semaphore(_MAX_REQUESTS)
        try:
            conn = await self._hello(reader, writer)
            if conn is None:
                return
            while True:
                await slots.acquire()  # at most _MAX_REQUESTS at once: a flood waits in the socket, not in memory
                line = await reader.readline()
                if not line:
                    break
                # Requests run concurrently: a long-polling claim does not hold back heartbeats and results.
                request = asyncio.create_task(self._request(conn, line, writer))
                requests.add(request)
                request.add_done_callback(requests.discard)
                request.add_done_callback(functools.partial(self._request_done, slots))
                self.requests_in_progress += 1
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
            log.info("worker connection ended: %s", e)
        finally:
            for request in requests:
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
            if conn is not None:
                await asyncio.shield(self._requeue(conn))
            writer.close()
            self.connections.discard(task)

    def _request_done(self, slots: asyncio.Semaphore, request: asyncio.Task[None]) -> None:
        slots.release()
        self.requests_in_progress -= 1

    async def _send(self, writer: asyncio.StreamWriter, body: dict[str, Any], lock: asyncio.Lock | None = None) -> None:
        data = json.dumps(body, separators=(",", ":")).encode() + b"\n"
        if lock is None:
            writer.write(data)
            await writer.drain()
            return
        async with lock:
            writer.write(data)
            await writer.drain()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Connection | None:
        msg: Any = {}
        try:
            if len(self.connections) > self.config.max_connections:  # before reading: an idle flood is refused too
                raise ProtocolError("TooManyConnections", f"this bridge serves at most {self.config.max_connections} "
                                                          "worker connections")
            try:
                line = await asyncio.wait_for(reader.readline(), self.config.hello_timeout)
            except TimeoutError as e:
                raise ProtocolError("Timeout", f"no hello within {self.config.hello_timeout:g}s") from e
            except ValueError as e:  # the line is longer than the pre-authentication limit
                raise ProtocolError("Malformed", f"hello is longer than {_HELLO_LINE} bytes") from e
            msg = json.loads(line) if line else {}
            if not isinstance(msg, dict) or msg.get("op") != "hello":
                raise ProtocolError("Malformed", "the first message must be {\"op\": \"hello\", …}")
            if not self._known_token(msg.get("token")):
                raise ProtocolError("Unauthorized", "unknown token")
            handlers = msg.get("handlers")
            if not isinstance(handlers, list) or not all(isinstance(h, str) for h in handlers) or not handlers:
                raise ProtocolError("Malformed", "handlers must be a non-empty list of handler refs")
        except (ProtocolError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deeply
            kind = e.type if isinstance(e, ProtocolError) else "rdq.worker.Malformed"
            request_id = msg.get("id") if isinstance(msg, dict) else None
            await self._send(writer, {"id": request_id, "op": "error", "error": {"type": kind, "message": str(e)}})
            log.warning("worker refused: %s: %s", kind, e)
            return None
        reader._limit = _MAX_LINE  # type: ignore[attr-defined]  # authenticated: full-size lines from now on
        worker = str(msg.get("worker") or "worker")[:200]
        queues = [n for n in self.engine.config.queue_names()
                  if (q := self.engine.config.queue(n)) is not None and q.remote and q.handler in handlers]
        conn = _Connection(worker, set(handlers), queues)
        await self._send(writer, {"id": msg.get("id"), "op": "welcome", "protocol": PROTOCOL,
                                  "instance": self.engine.instance_id, "queues": queues})
        log.info("worker %s connected for %s (queues %s)", worker, sorted(handlers), queues)
        return conn

    def _known_token(self, token: Any) -> bool:
        """Compared as bytes in constant time (a str compare raised TypeError on non-ASCII input)."""
        if not isinstance(token, str):
            return False
        given = token.encode("utf-8", "surrogatepass")
        return any(hmac.compare_digest(given, t.get_secret_value().encode("utf-8")) for t in self.config.tokens)

    async def _request(self, conn: _Connection, line: bytes, writer: asyncio.StreamWriter) -> None:
        request_id = None
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ProtocolError("Malformed", "a request is a JSON object")
            request_id = msg.get("id")
            op = msg.get("op")
            if op == "claim":
                body = await self._claim(conn, msg)
            elif op == "heartbeat":
                body = await self._heartbeat(conn, msg)
            elif op == "result":
                body = await self._result(conn, msg)
            else:
                raise ProtocolError("UnknownOp", f"unknown op {op!r}")
        except ProtocolError as e:
            body = {"op": "error", "error": {"type": e.type, "message": str(e)}}
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            body = {"op": "error", "error": {"type": "rdq.worker.Malformed", "message": f"{type(e).__name__}: {e}"}}
        except StoreError as e:
            body = {"op": "error", "error": {"type": "rdq.worker.StoreUnavailable", "message": str(e)}}
        await self._send(writer, {"id": request_id, **body}, conn.write_lock)

    # ---- operations ------------------------------------------------------------------------------------

    async def _claim(self, conn: _Connection, msg: dict[str, Any]) -> dict[str, Any]:
        wanted = max(1, min(int(msg.get("max", 1)), 1000))
        deadline = asyncio.get_running_loop().time() + min(float(msg.get("wait", 0)), self.config.max_wait)
        owner = f"{self.engine.instance_id}/{conn.worker}"
        self._prune(conn)
        while True:
            claimed: list[Task] = []
            for name in conn.queues:
                queue = self.engine.config.queue(name)
                if queue is None or name in self.engine.scheduler.paused or len(claimed) >= wanted:
                    continue
                now = self.engine.clock.now_ms()
                claimed += await self.store.claim_due(name, wanted - len(claimed), queue.lease, owner, now)
            if claimed or asyncio.get_running_loop().time() >= deadline:
                break
            await self._wait_for_work(conn, deadline)
        now = self.engine.clock.now_ms()
        for task in claimed:
            conn.held[task.id] = _Held(task, now, task.lease_expires_at or now)
        return {"op": "tasks", "tasks": [self._task_json(t) for t in claimed]}

    def _prune(self, conn: _Connection) -> None:
        """Forget held tasks whose lease lapsed (the sweep reclaims them; a result for one is a late result)."""
        now = self.engine.clock.now_ms()
        for task_id in [i for i, held in conn.held.items() if held.expires_at <= now]:
            del conn.held[task_id]

    async def _wait_for_work(self, conn: _Connection, deadline: float) -> None:
        events = [self.engine.scheduler.wake_event(q) for q in conn.queues]
        for event in events:
            event.clear()
        timeout = max(0.0, min(deadline - asyncio.get_running_loop().time(), 0.25))
        await first_of(*events, timeout=timeout)

    def _task_json(self, task: Task) -> dict[str, Any]:
        return {
            "task_id": task.id, "token": self.leases.issue(task.id, task.lease_token), "queue": task.queue,
            "handler_ref": task.handler_ref, "handler_version": task.handler_version, "attempt": task.attempt_count,
            "redrive_count": task.redrive_count, "payload_b64": base64.b64encode(task.payload).decode("ascii"),
            "content_type": task.payload_content_type, "headers": task.headers,
            "lease_expires_at": rfc3339(task.lease_expires_at),
        }  # fmt: skip

    async def _heartbeat(self, conn: _Connection, msg: dict[str, Any]) -> dict[str, Any]:
        """Extends only a lease this connection holds, under the token it was given; anything else: ok false."""
        task_id = str(msg["task_id"])
        token = self.leases.verify(task_id, msg.get("token"))
        held = conn.held.get(task_id)
        ok = False
        if held is not None and held.task.lease_token == token:
            queue = self.engine.config.queue(held.task.queue)
            now = self.engine.clock.now_ms()
            lease = queue.lease if queue else 30.0
            ok = await self.store.extend_lease(task_id, token, lease, now)
            held.expires_at = now + int(lease * 1000)
        if not ok:
            conn.held.pop(task_id, None)
        return {"op": "heartbeat", "task_id": task_id, "ok": ok}

    async def _result(self, conn: _Connection, msg: dict[str, Any]) -> dict[str, Any]:
        task_id = str(msg["task_id"])
        token = self.leases.verify(task_id, msg.get("token"))
        outcome = _OUTCOMES.get(str(msg.get("outcome")))
        if outcome is None:
            raise ProtocolError("Malformed", "outcome must be success, retryable or permanent")
        retry_after = _retry_after(msg.get("retry_after"))
        held = conn.held.get(task_id)
        if held is not None and held.task.lease_token == token:
            del conn.held[task_id]
            task, started = held.task, held.started_at
        else:  # not (or no longer) this connection's lease: a late result, judged by its own token
            current = await self.store.get(task_id)
            if current is None:
                return {"op": "result", "task_id": task_id, "accepted": False, "status": None}
            queue = self.engine.config.queue(current.queue)
            if queue is None or not queue.remote or queue.handler not in conn.handlers:
                raise ProtocolError("NotServed", f"task {task_id} is not of a remote queue this worker serves")
            # The store's attempt count, never the worker's: the decision to retry or dead-letter is the store's.
            task, started = dataclasses.replace(current, lease_token=token), self.engine.clock.now_ms()
        queue = self.engine.config.queue(task.queue)
        if queue is None:
            raise ProtocolError("UnknownQueue", f"queue {task.queue!r} is not configured here")
        error = msg.get("error") or {}
        if not isinstance(error, dict):
            raise ProtocolError("Malformed", "error must be an object")
        info = None if outcome == Outcome.SUCCESS else ErrorInfo(
            str(error.get("type") or "RemoteError"), str(error.get("message") or ""),
            None if error.get("stack") is None else str(error["stack"]))
        result = RunOutcome(outcome, info, retry_after)
        self.engine.telemetry.metrics.attempt(task.queue, outcome, (self.engine.clock.now_ms() - started) / 1000)
        recorded = await self.engine.scheduler.record(task, queue, started, result, worker=conn.worker)
        current_task = await self.store.get(task_id)
        return {"op": "result", "task_id": task_id, "accepted": recorded.accepted,
                "status": current_task.status.value if current_task else None}

    async def _requeue(self, conn: _Connection) -> None:
        """The worker is gone: its leases are reclaimed now (the fast path), each with a LEASE_EXPIRED attempt."""
        now = self.engine.clock.now_ms()
        for task_id, held in list(conn.held.items()):
            queue = self.engine.config.queue(held.task.queue)
            if queue is None:
                continue
            row = {"id": task_id, "lease_token": held.task.lease_token, "lease_owner": held.task.lease_owner,
                   "lease_started_at": held.started_at, "attempt_count": held.task.attempt_count,
                   "redrive_count": held.task.redrive_count}
            decision = decide(queue, Outcome.RETRYABLE_FAILURE, held.task.attempt_count)
            next_at = None if decision.retry_after is None else now + int(decision.retry_after * 1000)
            error = ErrorInfo("rdq.WorkerGone", f"worker {conn.worker} disconnected while holding the task")
            try:
                if await self.store.expire_lease(row, now, next_at, error, holder_gone=True):
                    log.info("worker %s gone: task re-queued at once", conn.worker, extra={"task_id": task_id})
                    self.engine.scheduler.wake(held.task.queue)
            except StoreError as e:
                log.error("could not re-queue a gone worker's task (its lease will lapse): %s", e)
        conn.held.clear()


def _retry_after(value: Any) -> float | None:
    """A worker's `retry_after`: absent, or a finite number of seconds >= 0 (the queue then caps it)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ProtocolError("Malformed", "retry_after must be a finite number of seconds >= 0")
    return float(value)
