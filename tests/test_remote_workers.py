"""Remote workers over TCP and a Unix socket: claims, heartbeats, results, the socket-drop fast path, late
results (SPEC §8.2, §4.5), tokens."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bridge.config import parse_config
from bridge.engine.core import Engine
from bridge.live_config import LiveConfig
from bridge.model import NewTask, Outcome, Status
from bridge.registry import Registry
from bridge.store.tasks import Store
from bridge.workers.client import Connection, WorkerClient, WorkerError
from bridge.workers.server import WorkerServer

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "worker-token"


class Bench:
    def __init__(self, engine: Engine, server: WorkerServer) -> None:
        self.engine, self.server, self.store = engine, server, engine.store
        self.offsets = itertools.count()

    @property
    def tcp(self) -> str:
        return next(a for a in self.server.bound if a.startswith("tcp://"))

    @property
    def unix(self) -> str:
        return next(a for a in self.server.bound if a.startswith("unix://"))

    async def submit(self, payload: dict[str, Any]) -> str:
        now = self.engine.clock.now_ms()
        # A distinct source per task: tasks are unique per source record, and two submits can share a millisecond.
        source = f"kafka://t/0/{next(self.offsets)}"
        task = NewTask("r", "remote-example", json.dumps(payload).encode(), {"rdq.source": source},
                       Status.PENDING, now, None, next_attempt_at=now)
        task_id = await self.store.submit(task)
        self.engine.scheduler.wake("r")
        return task_id

    async def until(self, task_id: str, check: Any, within: float = 15.0) -> Any:
        deadline = time.monotonic() + within
        while True:
            task = await self.store.get(task_id)
            if task is not None and check(task):
                return task
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met: {task}")
            await asyncio.sleep(0.05)


@pytest.fixture
async def bench(tmp_path: Path) -> AsyncIterator[Bench]:
    config = parse_config({
        "kafka": {"bootstrap_servers": "127.0.0.1:1"}, "store": {"path": str(tmp_path / "rdq.db")},
        "queues": {"r": {"handler": "remote-example", "remote": True, "lease": "60s", "max_attempts": 5,
                         "backoff": {"kind": "fixed", "base": "10ms"}}},
        "workers": {"listen": ["tcp://127.0.0.1:0", f"unix://{tmp_path}/w.sock"], "tokens": [TOKEN]},
        "engine": {"sweep_interval": "50ms", "grace_period": "2s", "handler_modules": []},
    })
    store = await Store.open(config.store.path)
    engine = Engine(store, LiveConfig(config), Registry(), instance_id="bridge-1")
    assert config.workers is not None
    server = WorkerServer(config.workers, engine)
    stop = asyncio.Event()
    parts = [asyncio.create_task(engine.run(stop)), asyncio.create_task(server.run(stop))]
    while len(server.bound) < 2:  # noqa: ASYNC110 - waiting for the listeners to bind
        await asyncio.sleep(0.01)
    yield Bench(engine, server)
    stop.set()
    await asyncio.gather(*parts)
    engine.close()
    await store.close()


def start_worker(address: str, name: str, log: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "handlers.remote_worker_example", "--address", address,
                             "--token", TOKEN, "--name", name, "--heartbeat", "0.5"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env={**__import__("os").environ, "RDQ_EXAMPLE_LOG": str(log)})
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["op"] == "welcome"
    return proc


async def test_a_killed_worker_s_task_is_claimed_again_at_once(bench: Bench, tmp_path: Path) -> None:
    log = tmp_path / "workers.log"
    task_id = await bench.submit({"ms_first": 120_000})  # only the first attempt is slow
    a = await asyncio.to_thread(start_worker, bench.tcp, "A", log)
    try:
        await bench.until(task_id, lambda t: t.status == Status.IN_FLIGHT and t.lease_owner.endswith("/A"))
        killed_at = time.monotonic()
        a.send_signal(signal.SIGKILL)
        a.wait()
        requeued = await bench.until(task_id, lambda t: t.status == Status.PENDING)
        b = await asyncio.to_thread(start_worker, bench.unix, "B", log)  # the other socket kind
        try:
            done = await bench.until(task_id, lambda t: t.status == Status.SUCCEEDED)
            took = time.monotonic() - killed_at
        finally:
            b.terminate()
            b.wait()
    finally:
        a.kill()
    assert took < 10, f"re-claimed after {took:.1f}s; the lease was 60s"
    assert requeued.attempts[-1].outcome == Outcome.LEASE_EXPIRED
    assert requeued.attempts[-1].error is not None and requeued.attempts[-1].error.type == "rdq.WorkerGone"
    assert [a.outcome for a in done.attempts] == [Outcome.LEASE_EXPIRED, Outcome.SUCCESS]
    assert done.attempts[-1].worker == "B"
    assert [json.loads(line)["worker"] for line in log.read_text().splitlines()] == ["B"]


def hello(address: str, name: str) -> Connection:
    conn = Connection(address)
    conn.call("hello", token=TOKEN, worker=name, handlers=["remote-example"])
    return conn


async def test_late_success_is_accepted_when_nothing_else_finished(bench: Bench) -> None:
    bench.engine.config.set_override("r", {"lease": "500ms"})
    task_id = await bench.submit({})
    a = await asyncio.to_thread(hello, bench.tcp, "A")
    [task] = (await asyncio.to_thread(a.call, "claim", max=1, wait=5))["tasks"]
    await bench.until(task_id, lambda t: t.status == Status.PENDING)  # A's lease lapsed; the sweep re-queued it
    bench.engine.scheduler.paused.add("r")  # nobody else claims it meanwhile
    answer = await asyncio.to_thread(a.call, "result", task_id=task_id, token=task["token"],
                                     outcome="success")
    assert answer["accepted"] and answer["status"] == "SUCCEEDED"
    done = await bench.store.get(task_id)
    assert done is not None and done.attempts[-1].late_result_of == 1 and done.attempts[-1].worker == "A"
    a.close()


async def test_late_success_is_refused_when_another_worker_finished_first(bench: Bench) -> None:
    bench.engine.config.set_override("r", {"lease": "500ms"})
    task_id = await bench.submit({})
    a = await asyncio.to_thread(hello, bench.tcp, "A")
    b = await asyncio.to_thread(hello, bench.unix, "B")
    [old] = (await asyncio.to_thread(a.call, "claim", max=1, wait=5))["tasks"]
    await bench.until(task_id, lambda t: t.status == Status.PENDING)
    [new] = (await asyncio.to_thread(b.call, "claim", max=1, wait=5))["tasks"]
    assert new["token"] != old["token"] and new["attempt"] == 2
    heartbeat = await asyncio.to_thread(a.call, "heartbeat", task_id=task_id, token=old["token"])
    assert heartbeat["ok"] is False  # A is told its lease is lost
    won = await asyncio.to_thread(b.call, "result", task_id=task_id, token=new["token"],
                                  outcome="success")
    lost = await asyncio.to_thread(a.call, "result", task_id=task_id, token=old["token"],
                                   outcome="success")
    assert won["accepted"] and not lost["accepted"] and lost["status"] == "SUCCEEDED"
    late_failure = await asyncio.to_thread(a.call, "result", task_id=task_id, token=old["token"],
                                           outcome="retryable", error={"type": "E", "message": "x"})
    assert not late_failure["accepted"]
    a.close()
    b.close()


async def test_retryable_and_permanent_results(bench: Bench) -> None:
    retry_id = await bench.submit({})
    dead_id = await bench.submit({})
    a = await asyncio.to_thread(hello, bench.tcp, "A")
    tasks = (await asyncio.to_thread(a.call, "claim", max=2, wait=5))["tasks"]
    by_id = {t["task_id"]: t for t in tasks}
    r = await asyncio.to_thread(a.call, "result", task_id=retry_id, token=by_id[retry_id]["token"],
                                outcome="retryable", retry_after=30, error={"type": "Busy", "message": "later"})
    d = await asyncio.to_thread(a.call, "result", task_id=dead_id, token=by_id[dead_id]["token"],
                                outcome="permanent", error={"type": "Bad", "message": "no"})
    assert r["status"] == "PENDING" and d["status"] == "DEAD"
    retried = await bench.store.get(retry_id)
    assert retried is not None and retried.next_attempt_at is not None
    assert retried.next_attempt_at - retried.attempts[-1].finished_at == 30_000
    a.close()


async def test_a_bad_token_is_refused(bench: Bench) -> None:
    client = WorkerClient(bench.tcp, "not-the-token", {"remote-example": lambda t: None})
    with pytest.raises(WorkerError, match=r"rdq\.worker\.Unauthorized"):
        await asyncio.to_thread(client.connect)


async def test_the_python_client_runs_tasks_end_to_end(bench: Bench) -> None:
    ids = [await bench.submit({"fail": 1}) for _ in range(3)]
    seen: list[tuple[str, int]] = []

    def work(task: Any) -> None:
        seen.append((task.task_id, task.attempt))
        if task.attempt <= 1:
            raise ConnectionError("first try fails")

    client = WorkerClient(bench.unix, TOKEN, {"remote-example": work}, name="py", wait=1.0)
    await asyncio.to_thread(client.connect)
    runner = asyncio.create_task(asyncio.to_thread(client.run))
    for task_id in ids:
        await bench.until(task_id, lambda t: t.status == Status.SUCCEEDED)
    client.stop()
    await runner
    assert sorted(seen) == sorted([(i, 1) for i in ids] + [(i, 2) for i in ids])


def error_type(conn: Connection, op: str, **fields: Any) -> str:
    try:
        conn.call(op, **fields)
    except WorkerError as e:
        return str(e).split(":")[0]
    raise AssertionError(f"{op} {fields} was not refused")


async def test_a_worker_cannot_forge_or_guess_a_lease_token(bench: Bench) -> None:
    """Tokens were the store's small counters: a worker could finish a task it never claimed by guessing one."""
    never_claimed = await bench.submit({})
    bench.engine.scheduler.paused.add("r")  # it stays PENDING: nobody claims it
    a = await asyncio.to_thread(hello, bench.tcp, "A")
    for forged in (0, 1, 2, "1", "1.00000000000000000000000000000000", None):
        kind = await asyncio.to_thread(error_type, a, "result", task_id=never_claimed, token=forged,
                                       outcome="success")
        assert kind == "rdq.worker.BadToken", forged
        beat = await asyncio.to_thread(error_type, a, "heartbeat", task_id=never_claimed, token=forged)
        assert beat == "rdq.worker.BadToken"
    task = await bench.store.get(never_claimed)
    assert task is not None and task.status == Status.PENDING and task.attempts == ()
    a.close()


async def test_a_worker_heartbeats_only_what_it_holds_and_the_store_counts_attempts(bench: Bench) -> None:
    task_id = await bench.submit({})
    bench.engine.config.set_override("r", {"max_attempts": 1})
    a = await asyncio.to_thread(hello, bench.tcp, "A")
    b = await asyncio.to_thread(hello, bench.unix, "B")
    [task] = (await asyncio.to_thread(a.call, "claim", max=1, wait=5))["tasks"]
    # B quotes A's token: B does not hold the lease, so the heartbeat is refused and changes nothing.
    before = await bench.store.get(task_id)
    assert (await asyncio.to_thread(b.call, "heartbeat", task_id=task_id, token=task["token"]))["ok"] is False
    assert await bench.store.get(task_id) == before
    for bad in (float("nan"), float("inf"), -1, "soon", True):
        kind = await asyncio.to_thread(error_type, a, "result", task_id=task_id, token=task["token"],
                                       outcome="retryable", retry_after=bad)
        assert kind == "rdq.worker.Malformed", bad
    # The worker says "attempt 1 of many"; the store knows this was the last attempt: DEAD, not retried.
    answer = await asyncio.to_thread(a.call, "result", task_id=task_id, token=task["token"], attempt=-5,
                                     outcome="retryable", error={"type": "E", "message": "x"})
    assert answer["accepted"] and answer["status"] == "DEAD"
    a.close()
    b.close()


async def test_a_late_result_is_only_for_a_remote_queue_the_worker_serves(bench: Bench) -> None:
    bench.engine.config.set_override("r", {"lease": "300ms"})
    task_id = await bench.submit({})
    a = await asyncio.to_thread(hello, bench.tcp, "A")
    [task] = (await asyncio.to_thread(a.call, "claim", max=1, wait=5))["tasks"]
    a.close()  # A is gone: the task is re-queued at once
    await bench.until(task_id, lambda t: t.status == Status.PENDING)
    bench.engine.scheduler.paused.add("r")
    other = Connection(bench.tcp)
    await asyncio.to_thread(other.call, "hello", token=TOKEN, worker="C", handlers=["something-else"])
    kind = await asyncio.to_thread(error_type, other, "result", task_id=task_id, token=task["token"],
                                   outcome="success")
    assert kind == "rdq.worker.NotServed"
    again = await asyncio.to_thread(hello, bench.tcp, "A2")  # A back on a new connection: its late success counts
    answer = await asyncio.to_thread(again.call, "result", task_id=task_id, token=task["token"], outcome="success")
    assert answer["accepted"] and answer["status"] == "SUCCEEDED"
    other.close()
    again.close()


async def test_requests_in_progress_are_bounded_per_connection(bench: Bench) -> None:
    a = await asyncio.to_thread(hello, bench.tcp, "A")
    flood = [{"id": f"c{i}", "op": "claim", "max": 1, "wait": 3} for i in range(300)]
    await asyncio.to_thread(a._file.write, b"".join(json.dumps(m).encode() + b"\n" for m in flood))
    await asyncio.to_thread(a._file.flush)
    await asyncio.sleep(1.0)
    assert 0 < bench.server.requests_in_progress <= 64
    a.close()


async def test_the_client_forgets_a_call_it_gave_up_on(bench: Bench) -> None:
    a = await asyncio.to_thread(hello, bench.tcp, "A")
    with pytest.raises(TimeoutError):
        await asyncio.to_thread(a.call, "claim", timeout=0.2, max=1, wait=2)
    assert a._pending == {}
    a.close()


def raw_socket(address: str) -> Any:
    import socket

    sock = socket.create_connection(tuple(address[len("tcp://"):].rsplit(":", 1)), timeout=10)  # type: ignore[arg-type]
    return sock


def read_line(sock: Any) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return json.loads(data) if data else {}


async def test_before_hello_a_peer_gets_a_few_kb_a_deadline_and_no_type_error(bench: Bench) -> None:
    """Before authentication a peer could send a 64 MiB line, wait forever, and a non-ASCII token raised
    TypeError out of the handler."""
    def oversized() -> dict[str, Any]:
        sock = raw_socket(bench.tcp)
        sock.sendall(b'{"op": "hello", "token": "' + b"x" * 100_000 + b'"}\n')
        answer = read_line(sock)
        sock.close()
        return answer

    assert (await asyncio.to_thread(oversized))["error"]["type"] == "rdq.worker.Malformed"

    def non_ascii() -> dict[str, Any]:
        sock = raw_socket(bench.tcp)
        sock.sendall(json.dumps({"op": "hello", "token": "wörker-tøken", "handlers": ["x"]}).encode() + b"\n")
        answer = read_line(sock)
        sock.close()
        return answer

    assert (await asyncio.to_thread(non_ascii))["error"]["type"] == "rdq.worker.Unauthorized"
    bench.server.config = bench.server.config.model_copy(update={"hello_timeout": 0.5})

    def silent() -> tuple[dict[str, Any], float]:
        sock = raw_socket(bench.tcp)
        began = time.monotonic()
        answer = read_line(sock)  # says nothing: the bridge gives up on it
        sock.close()
        return answer, time.monotonic() - began

    answer, waited = await asyncio.to_thread(silent)
    assert answer["error"]["type"] == "rdq.worker.Timeout" and waited < 5


async def test_worker_connections_are_capped(bench: Bench) -> None:
    bench.server.config = bench.server.config.model_copy(update={"max_connections": 2})
    first = await asyncio.to_thread(hello, bench.tcp, "A")
    second = await asyncio.to_thread(hello, bench.tcp, "B")
    third = Connection(bench.tcp)
    with pytest.raises(WorkerError, match="TooManyConnections"):
        await asyncio.to_thread(third.call, "hello", token=TOKEN, worker="C", handlers=["remote-example"])
    first.close()
    await asyncio.sleep(0.3)
    fourth = await asyncio.to_thread(hello, bench.tcp, "D")  # a slot freed
    for conn in (second, third, fourth):
        conn.close()


async def test_the_unix_socket_is_never_world_accessible(bench: Bench) -> None:
    import os
    import stat

    path = bench.unix[len("unix://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o007 == 0


def random_json(rng: Any, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**70), 10**30])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e308, float("inf"), float("nan")])
    if kind in (4, 5):
        return rng.choice(["", "x", "claim", "01TASK", "1.abc", "é\u2028", "a" * 300])
    if kind in (6, 7):
        return {rng.choice(["task_id", "token", "outcome", "max", "wait", "error", "retry_after", "attempt", "z"]):
                random_json(rng, depth + 1) for _ in range(rng.randrange(5))}
    return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]


async def test_random_protocol_messages_after_hello_get_clear_errors_and_the_connection_serves_on(
        bench: Bench) -> None:
    """400 random lines on an authenticated connection: each is answered exactly once — a result, or an
    `op: error` naming the problem — and the connection still serves a real claim afterwards."""
    import random

    rng = random.Random(20261130)
    lines: list[bytes] = []
    for n in range(400):
        msg = random_json(rng)
        if isinstance(msg, dict) or rng.random() < 0.7:
            msg = {**(msg if isinstance(msg, dict) else {}), "id": f"f{n}",
                   "op": rng.choice(["claim", "heartbeat", "result", "hello", "nope", None, 7])}
            if msg["op"] == "claim":
                msg["wait"] = 0
            lines.append(json.dumps(msg).encode())
        else:
            lines.append(rng.choice([b"not json", b"[" * 5000 + b"]" * 5000, b'{"id": 1', b"\xff\xfe"]))

    def run() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        sock = raw_socket(bench.tcp)
        reader = sock.makefile("rb")
        sock.sendall(json.dumps({"id": 0, "op": "hello", "token": TOKEN, "handlers": ["remote-example"]}).encode()
                     + b"\n")
        assert json.loads(reader.readline())["op"] == "welcome"
        sock.sendall(b"".join(line + b"\n" for line in lines))
        answers = [json.loads(reader.readline()) for _ in lines]
        sock.sendall(b'{"id": "last", "op": "claim", "max": 1, "wait": 0}\n')
        last = json.loads(reader.readline())
        sock.close()
        return answers, last

    answers, last = await asyncio.to_thread(run)
    assert len(answers) == len(lines)
    errors = [a for a in answers if a.get("op") == "error"]
    assert errors and all(a["error"]["type"].startswith("rdq.worker.") and a["error"]["message"] for a in errors)
    assert not any("Internal" in a["error"]["type"] for a in errors)
    assert last["id"] == "last" and last["op"] == "tasks"
