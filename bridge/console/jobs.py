"""The console's long operations — a bulk redrive (plan, canary, the rest at a rate) and a foreign DLQ import —
each run by the CLI's own code in a worker thread, watched by the page (progress, ETA) and cancellable."""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from bridge.admin.client import Replies
from bridge.cli.imports import Import
from bridge.cli.redrive import BulkRedrive
from bridge.config import BridgeConfig
from bridge.console.admin import ConsoleAdmin

KEPT_JOBS = 100  # finished jobs the console remembers (their pages) until it stops


@dataclass
class Job:
    kind: str  # "redrive" | "import"
    params: dict[str, Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    phase: str = "starting"  # starting → plan → canary → running → done | stopped | cancelled | failed
    began: float = field(default_factory=time.time)
    paced_since: float | None = None  # when the rest (after plan and canary) began: what its rate is over
    ended: float | None = None
    progress: dict[str, dict[str, Any]] = field(default_factory=dict)  # instance → its latest progress
    request_id: str | None = None  # the bulk redrive's, once sent (what cancel names)
    cancelled: bool = False
    report: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    exit_code: int | None = None

    def view(self) -> dict[str, Any]:
        done = sum(int(p.get("done") or 0) for p in self.progress.values())
        total = sum(int(p.get("total") or 0) for p in self.progress.values())
        elapsed = (self.ended or time.time()) - (self.paced_since or self.began)
        rate = done / elapsed if elapsed > 0 and done else 0.0
        eta = (total - done) / rate if rate > 0 and total > done else None
        return {"id": self.id, "kind": self.kind, "phase": self.phase, "params": self.params,
                "progress": self.progress, "done": done, "total": total, "rate": round(rate, 1),
                "eta_seconds": None if eta is None else round(eta, 1), "request_id": self.request_id,
                "cancelled": self.cancelled, "report": self.report, "error": self.error,
                "exit_code": self.exit_code, "running": self.ended is None}


class Cancelled(Exception):
    """The operator cancelled the job before its bulk redrive was sent (during the plan or the canary)."""


class _Watched:
    """The CLI's session, as the job's code calls it: each command moves the job's phase, each progress reply is
    kept for the page."""

    def __init__(self, admin: ConsoleAdmin, job: Job) -> None:
        self.admin = admin
        self.job = job

    def request(self, command: str, args: dict[str, Any], timeout: float = 5.0, instances: int | None = None,
                on_partial: Any = None, request_id: str | None = None) -> Replies:
        if command == "redrive" and self.job.cancelled and not args.get("dry_run"):
            raise Cancelled()
        if command == "redrive":
            self.job.phase = ("plan" if args.get("dry_run") else "canary" if "task_ids" in args else "running")
            if "shares" in args:
                self.job.request_id = request_id
                self.job.paced_since = time.time()
        return self.admin.request(command, args, timeout, instances, self._progress, request_id)

    def collect(self, replies: Replies, timeout: float = 5.0, instances: int | None = None,
                on_partial: Any = None) -> Replies:
        return self.admin.collect(replies, timeout, instances, self._progress)

    def _progress(self, reply: dict[str, Any]) -> None:
        self.job.progress[str(reply.get("instance", "?"))] = reply.get("result", {}).get("progress", {})


class Jobs:
    def __init__(self, admin: ConsoleAdmin, config: BridgeConfig) -> None:
        self.admin = admin
        self.config = config
        self.jobs: dict[str, Job] = {}

    def redrive(self, filters: dict[str, Any], canary: int, canary_min: float, canary_wait: float, rate: float,
                limit: int | None) -> Job:
        args = argparse.Namespace(queue=filters["queue"], error_type=filters.get("error_type"),
                                  since=filters.get("dead_since"), until=filters.get("dead_until"),
                                  force=bool(filters.get("force")), limit=limit, dry_run=False, canary=canary,
                                  canary_min=canary_min, canary_wait=canary_wait, rate=rate, json=True,
                                  timeout=30.0, instances=None)
        job = Job("redrive", {**filters, "canary": canary, "canary_min": canary_min, "rate": rate, "limit": limit})
        bulk = BulkRedrive(_Watched(self.admin, job), args, io.StringIO(), io.StringIO(), interactive=False)
        job.report = bulk.report  # filled as it goes: the canary's verdict shows before the rest ends

        def work(out: io.StringIO) -> int:
            bulk.out = out
            return bulk.run()

        return self._start(job, work)

    def imports(self, topic: str, queue: str, error_type: str | None, rate: float, dry_run: bool) -> Job:
        args = argparse.Namespace(topic=topic, queue=queue, error_type=error_type, rate=rate, dry_run=dry_run,
                                  json=True, timeout=30.0, instances=None, instance=None)
        job = Job("import", {"topic": topic, "queue": queue, "error_type": error_type, "rate": rate,
                             "dry_run": dry_run})
        job.phase = "running"
        return self._start(job, lambda out: Import(_Watched(self.admin, job), self.config, args, out,
                                                   io.StringIO()).run())

    def _start(self, job: Job, work: Any) -> Job:
        self.jobs[job.id] = job
        ended = [j for j in self.jobs.values() if j.ended is not None]
        for old in ended[: max(0, len(ended) - KEPT_JOBS)]:  # the oldest finished ones go
            del self.jobs[old.id]

        def run() -> None:
            out = io.StringIO()
            try:
                job.exit_code = work(out)
                job.report = json.loads(out.getvalue() or "{}")
                for r in job.report.get("replies", []):  # the final count of each instance, past its last progress
                    if r.get("ok"):
                        instance, count = str(r.get("instance")), int(r["result"].get("count") or 0)
                        total = max(count, int(job.progress.get(instance, {}).get("total") or 0))
                        job.progress[instance] = {"done": count, "total": total}
                job.phase = ("cancelled" if job.cancelled else
                             "stopped" if job.report.get("summary", {}).get("stopped_by_canary") else "done")
            except Cancelled:
                job.phase = "cancelled"
            except Exception as e:  # the page shows why; the console goes on
                job.error, job.phase = f"{type(e).__name__}: {e}", "failed"
            finally:
                job.ended = time.time()

        threading.Thread(target=run, name=f"rdq-console-{job.kind}-{job.id}", daemon=True).start()
        return job

    async def cancel(self, job: Job) -> dict[str, Any] | None:
        """Stop a bulk redrive on every instance at its next batch (what it redrove stays redriven)."""
        job.cancelled = True
        if job.request_id is None:
            return None
        answers = await self.admin.ask("cancel", {"request_id": job.request_id})
        return {"replies": answers.replies}
