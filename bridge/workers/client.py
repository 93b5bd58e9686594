"""A small Python client for the remote-worker protocol (docs/remote-workers.md).

    client = WorkerClient("tcp://127.0.0.1:7070", token="…", handlers={"charge-payment": charge}, name="w-1")
    client.run()          # claim → run → result, heartbeating while a handler runs, until stop() or Ctrl-C

A handler is `fn(task: RemoteTask) -> None`: return for success, raise `Retry(after=…)` or `Permanent(...)`
(from bridge.handler_api); any other exception is reported as a retryable failure. Blocking and threaded on
purpose: it is the reference for clients in other languages, so it stays plain.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import socket
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bridge.handler_api import LeaseLost, Permanent, Retry


class WorkerError(RuntimeError):
    pass


def connect(address: str, timeout: float = 10.0) -> socket.socket:
    if address.startswith("unix://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(address[len("unix://"):])
    elif address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    else:
        raise WorkerError(f"address must be tcp://host:port or unix:///path, not {address!r}")
    sock.settimeout(None)
    return sock


class Connection:
    """Requests with ids; one reader thread routes each answer to its caller (heartbeats run beside claims)."""

    def __init__(self, address: str) -> None:
        self._sock = connect(address)
        self._file = self._sock.makefile("rwb")
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._refused: dict[str, Any] | None = None  # an error about the whole connection (no request id)
        self._closed = False
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="rdq-worker-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self._file:
                msg = json.loads(line)
                if msg.get("id") is None and msg.get("op") == "error":  # about the connection: every caller hears it
                    self._refused = msg
                    for waiting in list(self._pending.values()):
                        if not waiting.done():
                            waiting.set_result(msg)
                    continue
                future = self._pending.pop(msg.get("id"), None)
                if future is not None:
                    future.set_result(msg)
        except (OSError, ValueError):
            pass
        for future in list(self._pending.values()):
            if not future.done():
                if self._refused is not None:
                    future.set_result(self._refused)
                else:
                    future.set_exception(WorkerError("connection closed"))
        self._closed = True
        self._pending.clear()

    def call(self, op: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        request_id = next(self._ids)
        future: Future[dict[str, Any]] = Future()
        self._pending[request_id] = future
        if self._refused is not None or self._closed:  # it came before this call: answer with it
            self._pending.pop(request_id, None)
            if self._refused is None:
                raise WorkerError("connection closed")
            error = self._refused["error"]
            raise WorkerError(f"{error['type']}: {error['message']}")
        with self._lock:
            self._file.write(json.dumps({"id": request_id, "op": op, **fields}).encode() + b"\n")
            self._file.flush()
        try:
            answer = future.result(timeout)
        finally:
            self._pending.pop(request_id, None)  # answered, or given up on: an answer that comes later is dropped
        if answer.get("op") == "error":
            raise WorkerError(f"{answer['error']['type']}: {answer['error']['message']}")
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


@dataclass
class RemoteTask:
    task_id: str
    token: str  # opaque: quoted back as received
    queue: str
    handler_ref: str
    attempt: int
    redrive_count: int
    payload: bytes
    content_type: str
    headers: dict[str, str]
    _conn: Connection = field(repr=False)
    _lost: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any], conn: Connection) -> RemoteTask:
        return cls(data["task_id"], str(data["token"]), data["queue"], data["handler_ref"], int(data["attempt"]),
                   int(data["redrive_count"]), base64.b64decode(data["payload_b64"]), data["content_type"],
                   dict(data["headers"]), conn)

    def heartbeat(self) -> None:
        """Keep the lease; raises LeaseLost once the bridge says it is gone (abandon the work)."""
        if self._lost.is_set():
            raise LeaseLost(f"task {self.task_id}: lease lost")
        if not self._conn.call("heartbeat", task_id=self.task_id, token=self.token)["ok"]:
            self._lost.set()
            raise LeaseLost(f"task {self.task_id}: lease lost")


class WorkerClient:
    def __init__(self, address: str, token: str, handlers: dict[str, Callable[[RemoteTask], None]],
                 name: str = "python-worker", heartbeat_interval: float = 5.0, wait: float = 10.0) -> None:
        self.address = address
        self.token = token
        self.handlers = handlers
        self.name = name
        self.heartbeat_interval = heartbeat_interval
        self.wait = wait
        self._stop = threading.Event()
        self.conn: Connection | None = None
        self.results: list[dict[str, Any]] = []

    def connect(self) -> dict[str, Any]:
        self.conn = Connection(self.address)
        return self.conn.call("hello", token=self.token, worker=self.name, handlers=sorted(self.handlers),
                              protocol=2)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        if self.conn is None:
            self.connect()
        assert self.conn is not None
        try:
            while not self._stop.is_set():
                for data in self.conn.call("claim", timeout=self.wait + 30, max=1, wait=self.wait)["tasks"]:
                    self.results.append(self.work(RemoteTask.from_json(data, self.conn)))
        finally:
            self.conn.close()

    def work(self, task: RemoteTask) -> dict[str, Any]:
        """Run one task's handler (heartbeating meanwhile) and report its result. Returns the bridge's answer."""
        assert self.conn is not None
        done = threading.Event()
        beater = threading.Thread(target=self._beat, args=(task, done), daemon=True)
        beater.start()
        fields: dict[str, Any] = {"task_id": task.task_id, "token": task.token}
        try:
            self.handlers[task.handler_ref](task)
            fields["outcome"] = "success"
        except LeaseLost:
            done.set()
            return {"op": "result", "accepted": False, "abandoned": True}
        except Exception as e:
            fields["outcome"] = "permanent" if isinstance(e, Permanent) else "retryable"
            if isinstance(e, Retry) and e.after is not None:
                fields["retry_after"] = e.after
            fields["error"] = {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                               "stack": "".join(traceback.format_exception(e))[-8000:]}
        finally:
            done.set()
        return self.conn.call("result", **fields)

    def _beat(self, task: RemoteTask, done: threading.Event) -> None:
        while not done.wait(self.heartbeat_interval):
            try:
                task.heartbeat()
            except (LeaseLost, WorkerError):
                return
