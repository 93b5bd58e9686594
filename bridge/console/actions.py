"""The requests that change something (POST, CSRF-checked by the gate): redrive (plan, start, cancel, one task),
purge and skip (after their confirmation page), pause/resume, the breaker, import."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from bridge.console import views
from bridge.console.pages import filters_from
from bridge.console.site import Site

QUEUE_ACTIONS = {"pause": ("pause", {}), "resume": ("resume", {}),
                 "breaker-open": ("breaker", {"action": "open"}), "breaker-close": ("breaker", {"action": "close"})}


def _number(form: Any, name: str, default: float, low: float, high: float) -> float:
    try:
        value = float(form.get(name) or default)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{name} must be a number") from e
    if not low <= value <= high:
        raise web.HTTPBadRequest(text=f"{name} must be within {low:g}..{high:g}")
    return value


class Actions:
    def __init__(self, site: Site) -> None:
        self.site = site
        self.admin = site.admin

    async def plan(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        filters = filters_from(form)
        if "queue" not in filters:
            raise web.HTTPBadRequest(text="a redrive needs a queue")
        args: dict[str, Any] = {k: v for k, v in filters.items() if k not in ("key", "text")}
        if form.get("force"):
            args["force"] = True
        answers = await self.admin.ask("redrive", {**args, "dry_run": True, "limit": 100_000})
        return self.site.render(request, "redrive.html", page="redrive", filters=filters, force=bool(form.get("force")),
                                plan=views.plan(answers.replies), queues=sorted(self.site.config.queues),
                                answers=answers)

    async def start(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        filters: dict[str, Any] = {k: v for k, v in filters_from(form).items() if k not in ("key", "text")}
        if "queue" not in filters:
            raise web.HTTPBadRequest(text="a redrive needs a queue")
        filters["force"] = bool(form.get("force"))
        limit = int(_number(form, "limit", 100_000, 1, 100_000))
        job = self.site.jobs.redrive(filters, canary=int(_number(form, "canary", 0, 0, 1000)),
                                     canary_min=_number(form, "canary_min", 0.9, 0, 1),
                                     canary_wait=_number(form, "canary_wait", 60, 1, 3600),
                                     rate=_number(form, "rate", 100, 0.01, 100_000), limit=limit)
        raise web.HTTPSeeOther(f"/jobs/{job.id}")

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        job = self.site.jobs.jobs.get(request.match_info["job_id"])
        if job is None:
            raise web.HTTPNotFound(text="no such job")
        await self.site.jobs.cancel(job)
        raise web.HTTPSeeOther(f"/jobs/{job.id}")

    async def redrive_task(self, request: web.Request) -> web.StreamResponse:
        task_id = request.match_info["task_id"]
        form = await request.post()
        answers = await self.admin.ask("redrive", {"task_id": task_id, "force": bool(form.get("force"))})
        return self._result(request, "redrive", answers, back=f"/task/{task_id}")

    async def purge(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        if form.get("confirm") != "yes":
            raise web.HTTPBadRequest(text="a purge needs its confirmation")
        if form.get("task_id"):
            args: dict[str, Any] = {"task_id": str(form["task_id"])}
        else:
            args = {"queue": str(form.get("queue", "")), "status": str(form.get("status") or "DEAD")}
        answers = await self.admin.ask("purge", args)
        return self._result(request, "purge", answers, back="/dead")

    async def skip(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        if form.get("confirm") != "yes":
            raise web.HTTPBadRequest(text="a skip needs its confirmation")
        task_id = str(form.get("task_id", ""))
        answers = await self.admin.ask("skip", {"task_id": task_id})
        return self._result(request, "skip", answers, back=f"/task/{task_id}")

    async def queue(self, request: web.Request) -> web.StreamResponse:
        queue, action = request.match_info["queue"], request.match_info["action"]
        if action not in QUEUE_ACTIONS:
            raise web.HTTPNotFound()
        command, extra = QUEUE_ACTIONS[action]
        answers = await self.admin.ask(command, {"queue": queue, **extra})
        if answers.errors() or not answers.replies:
            return self._result(request, command, answers, back="/")
        raise web.HTTPSeeOther("/")

    async def imports(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        topic, queue = str(form.get("topic", "")).strip(), str(form.get("queue", "")).strip()
        if not topic or not queue:
            raise web.HTTPBadRequest(text="an import needs a topic and a queue")
        job = self.site.jobs.imports(topic, queue, str(form.get("error_type") or "").strip() or None,
                                     _number(form, "rate", 1000, 1, 100_000), dry_run=form.get("dry_run") == "1")
        raise web.HTTPSeeOther(f"/jobs/{job.id}")

    def _result(self, request: web.Request, command: str, answers: Any, back: str) -> web.StreamResponse:
        return self.site.render(request, "result.html", page="", command=command, answers=answers, back=back)
