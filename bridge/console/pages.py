"""The pages (GET): overview, dead letters, a task, the redrive form and its plan, a job, import, audit."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from aiohttp import web

from bridge.console import views
from bridge.console.preview import bars_by_count, bars_over_time, duration_ms, preview, trace_id
from bridge.console.site import Site
from bridge.records import source_headers, source_key

LIST_LIMIT = 200  # dead tasks listed per page (the counts and charts cover every match)


def filters_from(query: Any) -> dict[str, str]:
    """The dead letters' filter from a query string or form; times as RFC 3339 (a browser's datetime-local is
    taken as UTC)."""
    picked = {}
    for name in views.FILTERS:
        value = str(query.get(name, "")).strip()
        if value:
            picked[name] = _rfc3339(value) if name in ("dead_since", "dead_until") else value
    return picked


def _rfc3339(value: str) -> str:
    if value.endswith("Z") or "+" in value[10:]:
        return value
    at = dt.datetime.fromisoformat(value)
    return at.strftime("%Y-%m-%dT%H:%M:%S") + "Z"


def record_of(headers: dict[str, str]) -> dict[str, Any]:
    """The source record's key and headers as the task carries them (base64 in rdq.kafka.*), as text."""
    key = source_key(headers)
    return {"key": None if key is None else key.decode("utf-8", "backslashreplace"),
            "headers": [(name, "" if value is None else value.decode("utf-8", "backslashreplace"))
                        for name, value in source_headers(headers)]}


class Pages:
    def __init__(self, site: Site) -> None:
        self.site = site
        self.admin = site.admin

    async def overview(self, request: web.Request) -> web.StreamResponse:
        answers = await self.admin.ask("stats", {})
        data = views.overview(answers.replies)
        return self.site.render(request, "overview.html", page="overview", answers=answers, **data)

    async def dead(self, request: web.Request) -> web.StreamResponse:
        filters = filters_from(request.query)
        bucket = request.query.get("bucket", "1h")
        bucket_ms = views.BUCKETS.get(bucket, views.BUCKETS["1h"])
        listed, summed = await asyncio.gather(
            self.admin.ask("list", {**filters, "status": "DEAD", "newest": True, "limit": LIST_LIMIT}),
            self.admin.ask("insights", {**filters, "bucket_ms": bucket_ms}))
        found = views.insights(summed.replies)
        return self.site.render(
            request, "dead.html", page="dead", filters=filters, bucket=bucket, buckets=list(views.BUCKETS),
            rows=views.dead_rows(listed.replies, LIST_LIMIT), insights=found, answers=listed,
            chart=bars_over_time(found["over_time"], found["bucket_ms"]),
            outcomes=bars_by_count(found["attempts_by_outcome"]), errors=listed.errors() + summed.errors())

    async def task(self, request: web.Request) -> web.StreamResponse:
        task_id = request.match_info["task_id"]
        answers = await self.admin.ask("get", {"task_id": task_id})
        task, instance = views.first_task(answers.replies)
        if task is None:
            return self.site.render(request, "missing.html", status=404, page="dead", task_id=task_id,
                                    answers=answers)
        attempts = [{**a, "duration_ms": duration_ms(a.get("started_at"), a.get("finished_at"))}
                    for a in task.get("attempts", [])]
        traceparent = task.get("headers", {}).get("traceparent")
        found = trace_id(traceparent)
        trace_link = self.site.trace_url.replace("{trace_id}", found) if self.site.trace_url and found else None
        return self.site.render(request, "task.html", page="dead", task=task, instance=instance, attempts=attempts,
                                payload=preview(task.get("payload", ""), task.get("payload_content_type", "")),
                                trace_link=trace_link, answers=answers, record=record_of(task.get("headers", {})))

    async def redrive(self, request: web.Request) -> web.StreamResponse:
        return self.site.render(request, "redrive.html", page="redrive", filters=filters_from(request.query),
                                plan=None, queues=sorted(self.site.config.queues))

    async def job(self, request: web.Request) -> web.StreamResponse:
        job = self.site.jobs.jobs.get(request.match_info["job_id"])
        if job is None:
            raise web.HTTPNotFound(text="no such job (the console keeps its jobs until it stops)")
        if request.path.endswith(".json"):
            return web.json_response(job.view())
        return self.site.render(request, "job.html", page="redrive", job=job.view())

    async def jobs(self, request: web.Request) -> web.StreamResponse:
        listed = sorted((j.view() for j in self.site.jobs.jobs.values()), key=lambda j: j["id"])
        return self.site.render(request, "jobs.html", page="redrive", jobs=listed)

    async def imports(self, request: web.Request) -> web.StreamResponse:
        return self.site.render(request, "import.html", page="import", queues=sorted(self.site.config.queues),
                                form=dict(request.query))

    async def audit(self, request: web.Request) -> web.StreamResponse:
        reads = request.query.get("reads") == "1"
        answers = await self.admin.ask("audit", {"reads": reads, "limit": 500})
        return self.site.render(request, "audit.html", page="audit", rows=views.audit(answers.replies),
                                reads=reads, answers=answers)

    async def confirm(self, request: web.Request) -> web.StreamResponse:
        """The confirmation of a purge or a skip: what it will do, and the button that does it."""
        action = request.match_info["action"]
        if action not in ("purge", "skip"):
            raise web.HTTPNotFound()
        return self.site.render(request, "confirm.html", page="dead", action=action, form=dict(request.query))
