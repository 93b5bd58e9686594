"""What a page shows, merged from every instance's replies (pure: no I/O), so the merging is tested alone."""

from __future__ import annotations

from typing import Any

STATUSES = ("PENDING", "IN_FLIGHT", "PARKED", "DEAD", "SUCCEEDED")
FILTERS = ("queue", "error_type", "dead_since", "dead_until", "key", "text")
BUCKETS = {"1m": 60_000, "10m": 600_000, "1h": 3_600_000, "1d": 86_400_000}


def overview(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """Per instance: queues by status, breakers, paused, partitions; and the queues summed over the group."""
    instances = []
    totals: dict[str, dict[str, int]] = {}
    for r in sorted(replies, key=lambda r: str(r.get("instance"))):
        if not r.get("ok"):
            instances.append({"name": r.get("instance"), "error": r.get("error", {})})
            continue
        result = r["result"]
        for queue, counts in result.get("queues", {}).items():
            into = totals.setdefault(queue, {s: 0 for s in STATUSES})
            for status, n in counts.items():
                into[status] = into.get(status, 0) + int(n)
        for queue in result.get("configured", []):
            totals.setdefault(queue, {s: 0 for s in STATUSES})
        changelog = result.get("changelog") or {}
        partitions = [{"name": name, **p} for name, p in sorted((changelog.get("partitions") or {}).items())]
        instances.append({"name": r.get("instance"), "queues": result.get("queues", {}),
                          "breakers": result.get("breakers", {}), "paused": result.get("paused", []),
                          "running": result.get("running"), "dlq_stuck": result.get("dlq_stuck", {}),
                          "threads_stuck": result.get("threads_stuck", {}), "partitions": partitions,
                          "changelog": bool(changelog),
                          "restoring": sum(1 for p in partitions if p.get("restoring"))})
    return {"instances": instances, "queues": dict(sorted(totals.items()))}


def dead_rows(replies: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Every instance's listed tasks, newest death first, each once (with the instance that holds it)."""
    rows: dict[str, dict[str, Any]] = {}
    for r in replies:
        if r.get("ok"):
            for task in r["result"].get("tasks", []):
                rows.setdefault(task["id"], {**task, "instance": r.get("instance")})
    ordered = sorted(rows.values(), key=lambda t: (t.get("finished_at") or "", t["id"]), reverse=True)
    return ordered[:limit]


def insights(replies: list[dict[str, Any]]) -> dict[str, Any]:
    total = 0
    by_type: dict[str, int] = {}
    over_time: dict[int, int] = {}
    outcomes: dict[str, int] = {}
    bucket_ms = BUCKETS["1h"]
    for r in replies:
        if not r.get("ok"):
            continue
        result = r["result"]
        total += int(result.get("total") or 0)
        bucket_ms = int(result.get("bucket_ms") or bucket_ms)
        for name, n in result.get("by_error_type", {}).items():
            by_type[name] = by_type.get(name, 0) + int(n)
        for t, n in result.get("over_time", []):
            over_time[int(t)] = over_time.get(int(t), 0) + int(n)
        for name, n in result.get("attempts_by_outcome", {}).items():
            outcomes[name] = outcomes.get(name, 0) + int(n)
    return {"total": total, "by_error_type": dict(sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0]))),
            "over_time": [[t, n] for t, n in sorted(over_time.items())], "bucket_ms": bucket_ms,
            "attempts_by_outcome": outcomes}


def audit(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per request, with every instance that received it, newest first."""
    rows: dict[str, dict[str, Any]] = {}
    for r in replies:
        if not r.get("ok"):
            continue
        for req in r["result"].get("requests", []):
            row = rows.setdefault(req["request_id"], {**req, "instances": []})
            row["instances"].append(r.get("instance"))
    return sorted(rows.values(), key=lambda row: (row.get("seen_at") or "", row["request_id"]), reverse=True)


def first_task(replies: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str | None]:
    """The task as the instance that holds it answered (the others answer `task: null`)."""
    for r in replies:
        if r.get("ok") and r["result"].get("task"):
            return r["result"]["task"], r.get("instance")
    return None, None


def plan(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """A dry run's answer: what each instance would redrive and what the loop guard refuses."""
    rows = []
    for r in sorted(replies, key=lambda r: str(r.get("instance"))):
        if r.get("ok"):
            result = r["result"]
            rows.append({"instance": r.get("instance"), "count": int(result.get("count") or 0),
                         "refused_count": int(result.get("refused_count") or 0),
                         "refused": result.get("refused") or []})
        else:
            rows.append({"instance": r.get("instance"), "error": r.get("error")})
    return {"rows": rows, "count": sum(row.get("count", 0) for row in rows),
            "refused": sum(row.get("refused_count", 0) for row in rows)}
