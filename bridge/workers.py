"""Remote workers (SPEC §8.2, §4.5): processes in any language claim tasks over a socket.

The protocol (docs/remote-workers.md) is newline-delimited JSON over TCP or a Unix socket: `hello` (token,
handler refs), then `claim`, `heartbeat` and `result` requests, each answered with the request's `id`.
A worker's tasks are held under leases like any other; when its connection drops they are re-queued at once
(a LEASE_EXPIRED attempt, counted against max_attempts), not when the leases lapse. Late results follow §4.5.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hmac
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from bridge.config import WorkersConfig
from bridge.engine import Engine
from bridge.model import ErrorInfo, Outcome, Task, rfc3339
from bridge.policy import decide
from bridge.runner import RunOutcome
from bridge.store import StoreError

log = logging.getLogger(__name__)
PROTOCOL = 1
_MAX_LINE = 64 * 1024 * 1024
_OUTCOMES = {"success": Outcome.SUCCESS, "retryable": Outcome.RETRYABLE_FAILURE,
             "permanent": Outcome.PERMANENT_FAILURE}


class ProtocolError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.type = f"rdq.worker.{kind}"


@dataclass
class _Held:
    task: Task
    started_at: int


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
        self.connections: set[asyncio.Task[None]] = set()
        self.bound: list[str] = []  # the addresses actually listened on (tcp port 0 → the real port)

    # ---- serving ---------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
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
            server = await asyncio.start_unix_server(self._serve, path=path, limit=_MAX_LINE)
            os.chmod(path, 0o660)
            self.bound.append(address)
            return server
        host, _, port = address[len("tcp://"):].rpartition(":")
        server = await asyncio.start_server(self._serve, host or "127.0.0.1", int(port), limit=_MAX_LINE)
        sockname = server.sockets[0].getsockname()
        self.bound.append(f"tcp://{sockname[0]}:{sockname[1]}")
        return server

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        conn: _Connection | None = None
        requests: set[asyncio.Task[None]] = set()
        try:
            conn = await self._hello(reader, writer)
            if conn is None:
                return
            while True:
                line = await reader.readline()
                if not line:
                    break
                # Requests run concurrently: a long-polling claim does not hold back heartbeats and results.
                request = asyncio.create_task(self._request(conn, line, writer))
                requests.add(request)
                request.add_done_callback(requests.discard)
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
        line = await reader.readline()
        msg: Any = {}
        try:
            msg = json.loads(line) if line else {}
            if not isinstance(msg, dict) or msg.get("op") != "hello":
                raise ProtocolError("Malformed", "the first message must be {\"op\": \"hello\", …}")
            token = msg.get("token")
            if not isinstance(token, str) or not any(hmac.compare_digest(token, t) for t in self.config.tokens):
                raise ProtocolError("Unauthorized", "unknown token")
            handlers = msg.get("handlers")
            if not isinstance(handlers, list) or not all(isinstance(h, str) for h in handlers) or not handlers:
                raise ProtocolError("Malformed", "handlers must be a non-empty list of handler refs")
        except (ProtocolError, ValueError) as e:
            kind = e.type if isinstance(e, ProtocolError) else "rdq.worker.Malformed"
            request_id = msg.get("id") if isinstance(msg, dict) else None
            await self._send(writer, {"id": request_id, "op": "error", "error": {"type": kind, "message": str(e)}})
            log.warning("worker refused: %s: %s", kind, e)
            return None
        worker = str(msg.get("worker") or "worker")
        queues = [n for n in self.engine.config.queue_names()
                  if (q := self.engine.config.queue(n)) is not None and q.remote and q.handler in handlers]
        conn = _Connection(worker, set(handlers), queues)
        await self._send(writer, {"id": msg.get("id"), "op": "welcome", "protocol": PROTOCOL,
                                  "instance": self.engine.instance_id, "queues": queues})
        log.info("worker %s connected for %s (queues %s)", worker, sorted(handlers), queues)
        return conn

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
        except (ValueError, KeyError, TypeError) as e:
            body = {"op": "error", "error": {"type": "rdq.worker.Malformed", "message": f"{type(e).__name__}: {e}"}}
        except StoreError as e:
            body = {"op": "error", "error": {"type": "rdq.worker.StoreUnavailable", "message": str(e)}}
        await self._send(writer, {"id": request_id, **body}, conn.write_lock)

    # ---- operations ------------------------------------------------------------------------------------

    async def _claim(self, conn: _Connection, msg: dict[str, Any]) -> dict[str, Any]:
        wanted = max(1, min(int(msg.get("max", 1)), 1000))
        deadline = asyncio.get_running_loop().time() + min(float(msg.get("wait", 0)), self.config.max_wait)
        owner = f"{self.engine.instance_id}/{conn.worker}"
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
            conn.held[task.id] = _Held(task, now)
        return {"op": "tasks", "tasks": [self._task_json(t) for t in claimed]}

    async def _wait_for_work(self, conn: _Connection, deadline: float) -> None:
        events = [self.engine.scheduler.wake_event(q) for q in conn.queues]
        for event in events:
            event.clear()
        timeout = max(0.0, min(deadline - asyncio.get_running_loop().time(), 0.25))
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            if waiters:
                await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(timeout)
        finally:
            for w in waiters:
                w.cancel()

    @staticmethod
    def _task_json(task: Task) -> dict[str, Any]:
        return {
            "task_id": task.id, "token": task.lease_token, "queue": task.queue, "handler_ref": task.handler_ref,
            "handler_version": task.handler_version, "attempt": task.attempt_count,
            "redrive_count": task.redrive_count, "payload_b64": base64.b64encode(task.payload).decode("ascii"),
            "content_type": task.payload_content_type, "headers": task.headers,
            "lease_expires_at": rfc3339(task.lease_expires_at),
        }  # fmt: skip

    async def _heartbeat(self, conn: _Connection, msg: dict[str, Any]) -> dict[str, Any]:
        task_id, token = str(msg["task_id"]), int(msg["token"])
        held = conn.held.get(task_id)
        queue = self.engine.config.queue(held.task.queue) if held else None
        lease = queue.lease if queue else 30.0
        ok = await self.store.extend_lease(task_id, token, lease, self.engine.clock.now_ms())
        if not ok:
            conn.held.pop(task_id, None)
        return {"op": "heartbeat", "task_id": task_id, "ok": ok}

    async def _result(self, conn: _Connection, msg: dict[str, Any]) -> dict[str, Any]:
        task_id, token = str(msg["task_id"]), int(msg["token"])
        outcome = _OUTCOMES.get(str(msg.get("outcome")))
        if outcome is None:
            raise ProtocolError("Malformed", "outcome must be success, retryable or permanent")
        held = conn.held.pop(task_id, None)
        task = held.task if held else await self.store.get(task_id)
        if task is None:
            return {"op": "result", "task_id": task_id, "accepted": False, "status": None}
        attempt = int(msg.get("attempt") or task.attempt_count)
        # The worker's token and attempt, not the store's current ones: a late result is judged by its own lease.
        task = dataclasses.replace(task, lease_token=token, attempt_count=attempt)
        queue = self.engine.config.queue(task.queue)
        if queue is None:
            raise ProtocolError("UnknownQueue", f"queue {task.queue!r} is not configured here")
        error = msg.get("error") or {}
        info = None if outcome == Outcome.SUCCESS else ErrorInfo(
            str(error.get("type") or "RemoteError"), str(error.get("message") or ""), error.get("stack"))
        retry_after = msg.get("retry_after")
        result = RunOutcome(outcome, info, float(retry_after) if retry_after is not None else None)
        started = held.started_at if held else self.engine.clock.now_ms()
        self.engine.telemetry.metrics.attempt(task.queue, outcome, (self.engine.clock.now_ms() - started) / 1000)
        recorded = await self.engine.scheduler.record(task, queue, started, result, worker=conn.worker)
        current = await self.store.get(task_id)
        return {"op": "result", "task_id": task_id, "accepted": recorded.accepted,
                "status": current.status.value if current else None}

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
