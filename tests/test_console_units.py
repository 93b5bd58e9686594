"""The console's parts without a broker: the store's filters and insights behind the dead letters page, the audit,
the merging of every instance's replies, the payload preview, and the gate (token, cookie, CSRF)."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from bridge.console import views
from bridge.console.gate import COOKIE, Gate
from bridge.console.preview import PREVIEW_BYTES, bars_over_time, preview
from bridge.model import ErrorInfo, NewTask
from bridge.records import KEY_B64
from bridge.store.reads import TaskFilter
from bridge.store.tasks import Store
from tests.helpers import T0, failure

HOUR = 3_600_000


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(tmp_path / "rdq.db")
    yield s
    await s.close()


def dead(error: str, message: str, at: int, key: bytes | None = None, queue: str = "q") -> NewTask:
    task = failure(queue=queue, now=at, dead=ErrorInfo(error, message))
    if key is None:
        return task
    return dataclasses.replace(task, headers={**task.headers, KEY_B64: base64.b64encode(key).decode()})


async def test_dead_tasks_filtered_by_key_text_and_time_newest_first(store: Store) -> None:
    ids = [await store.submit(dead("ConnectionError", "downstream is DOWN (503)", T0 + i * HOUR, f"k{i}".encode()))
           for i in range(5)]
    other = await store.submit(dead("ValueError", "bad record", T0 + 10 * HOUR, b"\xff\x00binary"))
    await store.submit(failure())  # PENDING: not dead
    newest = await store.filtered(TaskFilter(status="DEAD", newest=True), 100)
    assert [t.id for t in newest] == [other, *reversed(ids)]
    assert [t.id for t in await store.filtered(TaskFilter(status="DEAD", key="k3"), 10)] == [ids[3]]
    assert await store.filtered(TaskFilter(status="DEAD", key="k"), 10) == []  # a whole key, not a prefix
    assert len(await store.filtered(TaskFilter(status="DEAD", text="down (503"), 10)) == 5  # any case, no wildcard
    assert await store.filtered(TaskFilter(status="DEAD", text="d_wn"), 10) == []
    window = TaskFilter(status="DEAD", since=T0 + HOUR, until=T0 + 3 * HOUR)
    assert sorted(t.id for t in await store.filtered(window, 10)) == sorted(ids[1:3])
    assert [t.id for t in await store.filtered(TaskFilter(status="DEAD", newest=True), 2)] == [other, ids[4]]


async def test_insights_group_by_error_type_count_per_bucket_and_attempts_by_outcome(store: Store) -> None:
    for i in range(6):
        await store.submit(dead("ConnectionError", "down", T0 + (i % 3) * HOUR))
    await store.submit(dead("ValueError", "bad", T0 + 30 * 60_000))
    await store.submit(dead("ValueError", "bad", T0, queue="other"))
    found = await store.insights(TaskFilter(queue="q", status="DEAD"), HOUR)
    assert found["total"] == 7
    assert found["by_error_type"] == {"ConnectionError": 6, "ValueError": 1}
    assert [n for _, n in found["over_time"]] == [3, 2, 2]
    assert all(t % HOUR == 0 for t, _ in found["over_time"])
    assert found["attempts_by_outcome"] == {"PERMANENT_FAILURE": 7}
    only = await store.insights(TaskFilter(queue="q", status="DEAD", error_type="ValueError"), HOUR)
    assert only["total"] == 1 and only["by_error_type"] == {"ValueError": 1}


async def test_the_audit_keeps_what_changed_and_forgets_reads_after_the_replay_window(store: Store) -> None:
    assert await store.admin_seen("r1", "redrive", "console:sre", T0, "k2", {"queue": "q", "rate": 5.0})
    assert await store.admin_seen("r2", "stats", "console:sre", T0, "k2", {})
    assert not await store.admin_seen("r1", "redrive", "console:sre", T0, "k2", {})  # a replay
    assert await store.admin_seen("r3", "purge", "x" * 10, T0, None, {"task_id": "t" * 5000})
    rows = await store.admin_audit(None, 100, reads=False)
    assert [r["request_id"] for r in rows] == ["r1", "r3"] or [r["request_id"] for r in rows] == ["r3", "r1"]
    assert json.loads(next(r for r in rows if r["request_id"] == "r1")["args"]) == {"queue": "q", "rate": 5.0}
    capped = next(r for r in rows if r["request_id"] == "r3")["args"]
    assert len(capped) == 2000 and capped.endswith("…")
    assert len(await store.admin_audit(None, 100, reads=True)) == 3
    await store.admin_prune(before=T0 + 1, audit_before=T0 - 1)  # past the replay window, within the audit's
    assert [r["request_id"] for r in await store.admin_audit(None, 100, reads=True)] != []
    assert {r["command"] for r in await store.admin_audit(None, 100, reads=True)} == {"redrive", "purge"}
    await store.admin_prune(before=T0 + 1, audit_before=T0 + 1)
    assert await store.admin_audit(None, 100, reads=True) == []


def test_replies_of_two_instances_merge_into_one_page() -> None:
    a = {"instance": "a", "ok": True, "result": {"queues": {"q": {"DEAD": 2, "PENDING": 1}}, "configured": ["q", "r"],
                                                 "breakers": {"q": {"state": "open"}}, "paused": ["q"],
                                                 "changelog": {"partitions": {"t/1": {"open": 1, "restoring": True}}}}}
    b = {"instance": "b", "ok": True, "result": {"queues": {"q": {"DEAD": 3}}, "configured": ["q", "r"]}}
    broken = {"instance": "c", "ok": False, "error": {"type": "rdq.admin.StoreUnavailable", "message": "disk"}}
    page = views.overview([b, broken, a])
    assert page["queues"]["q"]["DEAD"] == 5 and page["queues"]["q"]["PENDING"] == 1 and page["queues"]["r"]["DEAD"] == 0
    assert [i["name"] for i in page["instances"]] == ["a", "b", "c"]
    assert page["instances"][0]["restoring"] == 1 and page["instances"][2]["error"]["message"] == "disk"
    listed = [{"instance": "a", "ok": True, "result": {"tasks": [{"id": "1", "finished_at": "2026-01-01T00:00:01Z"}]}},
              {"instance": "b", "ok": True, "result": {"tasks": [{"id": "2", "finished_at": "2026-01-01T00:00:02Z"},
                                                                 {"id": "1", "finished_at": "2026-01-01T00:00:01Z"}]}}]
    assert [(t["id"], t["instance"]) for t in views.dead_rows(listed, 10)] == [("2", "b"), ("1", "a")]
    summed = views.insights([
        {"ok": True, "result": {"total": 2, "by_error_type": {"E": 2}, "over_time": [[0, 2]], "bucket_ms": 60_000,
                                "attempts_by_outcome": {"RETRYABLE_FAILURE": 4}}},
        {"ok": True, "result": {"total": 1, "by_error_type": {"E": 1}, "over_time": [[60_000, 1]], "bucket_ms": 60_000,
                                "attempts_by_outcome": {"RETRYABLE_FAILURE": 2}}}])
    assert summed["total"] == 3 and summed["by_error_type"] == {"E": 3} and summed["over_time"] == [[0, 2], [60_000, 1]]
    assert summed["attempts_by_outcome"] == {"RETRYABLE_FAILURE": 6}
    audit = views.audit([{"instance": "a", "ok": True, "result": {"requests": [{"request_id": "r", "seen_at": "1"}]}},
                         {"instance": "b", "ok": True, "result": {"requests": [{"request_id": "r", "seen_at": "1"}]}}])
    assert audit == [{"request_id": "r", "seen_at": "1", "instances": ["a", "b"]}]
    chart = bars_over_time(summed["over_time"], 60_000)
    assert [b["n"] for b in chart["bars"]] == [2, 1] and chart["bars"][0]["h"] > chart["bars"][1]["h"]


def test_a_payload_is_shown_as_json_text_or_hex_and_capped() -> None:
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    assert preview(b64(b'{"a":[1,2]}')).kind == "json" and '"a": [' in preview(b64(b'{"a":[1,2]}')).text
    assert preview(b64("plain text é".encode())).kind == "text"
    binary = preview(b64(b"\x00\xff\x10binary"))
    assert binary.kind == "hex" and binary.text.startswith("00000000  00 ff 10")
    huge = preview(b64(b"x" * (PREVIEW_BYTES * 3)))
    assert huge.kind == "text" and huge.capped and huge.shown == PREVIEW_BYTES and huge.size == PREVIEW_BYTES * 3
    cut = preview(b64("é".encode() * PREVIEW_BYTES))  # the cap falls inside a two-byte character
    assert cut.kind == "text" and cut.capped
    assert preview("").kind == "empty"


async def test_the_gate_wants_the_token_then_the_cookie_and_a_csrf_token_for_changes() -> None:
    gate = Gate()
    changed: list[str] = []

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=f"csrf={gate.csrf_of(request)}")

    async def change(request: web.Request) -> web.Response:
        changed.append("yes")
        return web.Response(text="done")

    app = web.Application(middlewares=[gate.middleware])
    app.router.add_get("/", page)
    app.router.add_post("/change", change)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/")).status == 401
        assert (await client.get("/?token=" + "x" * len(gate.token))).status == 401
        login = await client.get(f"/?token={gate.token}", allow_redirects=False)
        assert login.status == 303 and login.headers["Location"] == "/"
        assert "HttpOnly" in login.headers["Set-Cookie"] and "SameSite=Strict" in login.headers["Set-Cookie"]
        csrf = (await (await client.get("/")).text()).removeprefix("csrf=")
        assert csrf
        assert (await client.post("/change", data={"x": "1"})).status == 403
        assert (await client.post("/change", data={"csrf": "forged"})).status == 403
        assert changed == []
        assert (await client.post("/change", data={"csrf": csrf})).status == 200
        assert (await client.post("/change", headers={"X-CSRF-Token": csrf})).status == 200
        client.session.cookie_jar.clear()
        assert (await client.post("/change", data={"csrf": csrf})).status == 401
        assert changed == ["yes", "yes"]
    assert COOKIE == "rdq_console"


def test_every_template_compiles_and_the_static_files_ship_beside_them() -> None:
    from importlib import resources

    from bridge.console.site import ENV

    names = ENV.list_templates()
    assert {"base.html", "overview.html", "dead.html", "task.html", "redrive.html", "job.html"} <= set(names)
    for name in names:
        ENV.get_template(name)  # a syntax error fails here, not on an SRE's first click
    static = resources.files("bridge.console") / "static"
    assert (static / "console.css").is_file() and (static / "console.js").is_file()
