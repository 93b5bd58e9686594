"""Tables for people (the CLI's default output); `--json` prints the replies as they came."""

from __future__ import annotations

from typing import Any

STATUSES = ("PENDING", "IN_FLIGHT", "PARKED", "SUCCEEDED", "DEAD")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def short(text: str | None, n: int = 60) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= n else text[: n - 1] + "…"


def errors(replies: list[dict[str, Any]]) -> list[str]:
    return [f"{r.get('instance')}: refused: {r['error']['type']}: {r['error']['message']}"
            for r in replies if not r.get("ok")]


def render(command: str, replies: list[dict[str, Any]]) -> str:
    ok = sorted((r for r in replies if r.get("ok")), key=lambda r: str(r.get("instance")))
    if not replies:
        return "no instance answered within the timeout"
    renderer = {"stats": _stats, "list": _list, "get": _get, "redrive": _redrive,
                "set-policy": _set_policy, "skip": _skip}.get(command, _generic)
    parts = [renderer(ok)] if ok else []
    return "\n".join([*parts, *errors(replies)])


def _stats(replies: list[dict[str, Any]]) -> str:
    if any("outcomes" in r["result"] for r in replies):  # `rdq stats --redrive ID`
        keys = ("succeeded", "failed", "waiting", "gone")
        return table(["INSTANCE", *(k.upper() for k in keys)],
                     [[r["instance"], *(r["result"]["outcomes"].get(k, 0) for k in keys)] for r in replies])
    rows = []
    for r in replies:
        result = r["result"]
        queues = set(result.get("queues", {})) | set(result.get("configured", []))
        stuck_dlq, stuck_threads = result.get("dlq_stuck", {}), result.get("threads_stuck", {})
        for queue in sorted(queues):
            counts = result["queues"].get(queue, {})
            breaker = result.get("breakers", {}).get(queue, {}).get("state", "closed")
            rows.append([r["instance"], queue, *(counts.get(s, 0) for s in STATUSES),
                         "yes" if queue in result.get("paused", []) else "", breaker,
                         stuck_dlq.get(queue, {}).get("entries", "") or "", stuck_threads.get(queue, "") or ""])
    out = table(["INSTANCE", "QUEUE", *STATUSES, "PAUSED", "BREAKER", "DLQ-STUCK", "THREADS-STUCK"], rows)
    partitions = [[r["instance"], name, p.get("open", 0), p.get("changelog_lag", 0),
                   "restoring" if p.get("restoring") else "ready", p.get("restored_tasks", ""),
                   p.get("restore_seconds", ""), p.get("unreadable", "") or ""]
                  for r in replies
                  for name, p in sorted(r["result"].get("changelog", {}).get("partitions", {}).items())]
    if partitions:
        out += "\n\n" + table(["INSTANCE", "PARTITION", "OPEN", "CHANGELOG-LAG", "STATE", "RESTORED", "SECONDS",
                                "UNREADABLE"], partitions)
    unreadable = [[r["instance"], name, n, r["result"].get("changelog", {}).get("quarantined", {}).get(name, 0)]
                  for r in replies
                  for name, n in sorted(r["result"].get("changelog", {}).get("unreadable", {}).items())]
    if unreadable:
        out += "\n\n" + table(["INSTANCE", "CHANGELOG-PARTITION", "UNREADABLE-RECORDS (kept, see the store)",
                                "QUARANTINED-TASKS (not run)"], unreadable)
    return out


def _list(replies: list[dict[str, Any]]) -> str:
    rows = [[r["instance"], t["id"], t["queue"], t["status"], t["attempt_count"], t["redrive_count"],
             t.get("next_attempt_at") or t.get("finished_at"), t.get("error_type"), t.get("source")]
            for r in replies for t in r["result"]["tasks"]]
    return table(["INSTANCE", "ID", "QUEUE", "STATUS", "ATT", "REDR", "NEXT/FINISHED", "ERROR", "SOURCE"], rows)


def task_view(task: dict[str, Any], instance: str | None = None) -> str:
    reason = task.get("dead_reason") or {}
    head = [
        f"task {task['id']}" + (f"  (held by {instance})" if instance else ""),
        f"  queue {task['queue']}  handler {task['handler_ref']}"
        + (f"@{task['handler_version']}" if task.get("handler_version") else ""),
        f"  status {task['status']}  attempts {task['attempt_count']}  redrives {task['redrive_count']}",
        f"  source {task['headers'].get('rdq.source', '')}  traceparent {task['headers'].get('traceparent', '')}",
        f"  created {task['created_at']}  next {task.get('next_attempt_at')}  finished {task.get('finished_at')}",
    ]
    if reason:
        head.append(f"  dead: {reason.get('type')}: {short(reason.get('message'), 100)}")
    if task.get("dlq"):
        dlq = task["dlq"]
        head.append(f"  dlq {dlq['state']} {dlq.get('topic') or ''}/{dlq.get('partition')}/{dlq.get('offset')}")
    ordering = task.get("ordering")
    if ordering:
        behind = task.get("waits_behind")
        line = f"  ordering: key {ordering['key']}  offset {ordering['seq']}" + (" (on_dead: hold)"
                                                                                if ordering.get("hold") else "")
        if behind:
            line += f"  — parked behind task {behind['id']} ({behind['status']})"
        if task.get("parked_behind"):
            line += f"  — {task['parked_behind']} record(s) of its key parked behind it"
        head.append(line)
    rows = [[a.get("redrive_no", 0), a["attempt_no"], a["outcome"], a["started_at"], a["finished_at"],
             (a.get("error") or {}).get("type"), short((a.get("error") or {}).get("message"), 50), a.get("worker")]
            for a in task.get("attempts", [])]
    out = "\n".join(head) + "\n\n" + table(["REDRIVE", "#", "OUTCOME", "STARTED", "FINISHED", "ERROR", "MESSAGE",
                                            "WORKER"], rows)
    redrives = task.get("redrives") or []
    if redrives:
        out += "\n\nredriven: " + "; ".join(
            f"#{d['redrive_no']} by {d.get('by')} (key {d.get('key_id')}, request {d.get('request_id')})"
            for d in redrives)
    return out


def _get(replies: list[dict[str, Any]]) -> str:
    views = [task_view(r["result"]["task"], r["instance"]) for r in replies if r["result"].get("task")]
    return "\n\n".join(views) if views else "no instance holds that task"


def _redrive(replies: list[dict[str, Any]]) -> str:
    rows = []
    for r in replies:
        result = r["result"]
        matched = result.get("matched")
        rows.append([r["instance"], "dry run" if result.get("dry_run") else "redriven",
                     result.get("count", 0), len(matched) if isinstance(matched, list) else matched,
                     short(result.get("note"), 70)])
    return table(["INSTANCE", "ACTION", "COUNT", "MATCHED", "NOTE"], rows)


def _skip(replies: list[dict[str, Any]]) -> str:
    rows = [[r["instance"], r["result"].get("task_id"), "skipped" if r["result"].get("skipped") else "-",
             r["result"].get("parked_behind", ""), r["result"].get("note") or ""]
            for r in replies if r["result"].get("held")]
    return table(["INSTANCE", "TASK", "RESULT", "PARKED BEHIND", "NOTE"], rows) if rows else "no instance holds it"


def _set_policy(replies: list[dict[str, Any]]) -> str:
    import json

    return table(["INSTANCE", "QUEUE", "POLICY NOW"],
                 [[r["instance"], r["result"].get("queue"), short(json.dumps(r["result"].get("policy")), 100)]
                  for r in replies])


def _generic(replies: list[dict[str, Any]]) -> str:
    return table(["INSTANCE", "RESULT"], [[r["instance"], short(str(r["result"]), 100)] for r in replies])
