"""`rdq redrive --queue Q`: a safe bulk redrive across every instance (SPEC §13).

1. Plan: a dry run on every instance says how many tasks each would redrive and which the loop guard refuses.
2. Canary (`--canary N`): N of them first; wait for their outcome; go on only if the success ratio reaches
   `--canary-min` (on a terminal, ask), else stop and say so.
3. The rest at `--rate` tasks/s for the whole group: each instance gets a share of the rate in proportion to the
   tasks it holds (so all finish together), and at most the tasks the plan counted on it.
4. Progress on a terminal (per instance, rate, ETA); a summary at the end: redriven, refused and why, where the
   redriven tasks are now. `--json` prints all of it as one object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from bridge.admin.client import Replies
from bridge.admin.protocol import MAX_REDRIVE_RATE

DEFAULT_RATE = 100.0  # tasks/s for the whole group (the bridge's own default is per instance: the same number)
CANARY_FAILED = 6  # exit code: the canary's success ratio was below --canary-min


class Session(Protocol):
    def request(self, command: str, args: dict[str, Any], timeout: float = 5.0, instances: int | None = None,
                on_partial: Any = None, request_id: str | None = None) -> Any: ...

    def collect(self, replies: Replies, timeout: float = 5.0, instances: int | None = None,
                on_partial: Any = None) -> Replies: ...


def filters_of(args: argparse.Namespace) -> dict[str, Any]:
    picked = {"queue": args.queue, "error_type": args.error_type, "dead_since": args.since,
              "dead_until": args.until, "force": args.force or None}
    return {k: v for k, v in picked.items() if v is not None}


def _ok(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in replies if r.get("ok")]


def _sum(replies: list[dict[str, Any]], key: str) -> int:
    return sum(int(r["result"].get(key) or 0) for r in _ok(replies))


def _outcomes(replies: list[dict[str, Any]]) -> dict[str, int]:
    total = {"succeeded": 0, "failed": 0, "waiting": 0, "gone": 0}
    for r in _ok(replies):
        for key, n in (r["result"].get("outcomes") or {}).items():
            total[key] = total.get(key, 0) + int(n)
    return total


def shares_for(counts: dict[str, int], rate: float) -> dict[str, dict[str, Any]]:
    """Each instance's part of the rate, in proportion to its tasks: every instance finishes at the same time and
    the group's pace is `rate`."""
    total = sum(counts.values())
    return {instance: {"rate": min(MAX_REDRIVE_RATE, max(0.01, rate * n / total)), "limit": n}
            for instance, n in counts.items() if n > 0}


def pick_canary(eligible: dict[str, list[str]], n: int) -> list[str]:
    """N task ids, taken from the instances in turn (a canary spread over the group, oldest deaths first)."""
    picked: list[str] = []
    queues = {instance: list(ids) for instance, ids in sorted(eligible.items())}
    while len(picked) < n and any(queues.values()):
        for ids in queues.values():
            if ids and len(picked) < n:
                picked.append(ids.pop(0))
    return picked


@dataclass
class Progress:
    """The progress line on a terminal: done/total per instance, the group's rate, the ETA."""

    out: TextIO
    began: float = field(default_factory=time.monotonic)
    latest: dict[str, dict[str, Any]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)

    def __call__(self, reply: dict[str, Any]) -> None:
        self.latest[reply.get("instance", "?")] = reply.get("result", {}).get("progress", {})
        self.out.write("\r" + self.line())
        self.out.flush()

    def line(self) -> str:
        done = sum(int(p.get("done") or 0) for p in self.latest.values())
        total = sum(self.totals.values()) or sum(int(p.get("total") or 0) for p in self.latest.values())
        rate = done / max(time.monotonic() - self.began, 1e-3)
        eta = (total - done) / rate if rate > 0 else float("inf")
        each = " · ".join(f"{i} {p.get('done')}/{p.get('total')}" for i, p in sorted(self.latest.items()))
        return (f"redrive: {done}/{total} ({100 * done / max(total, 1):.0f}%) · {rate:.0f}/s · "
                f"ETA {_duration(eta)} · {each}   ")

    def end(self) -> None:
        if self.latest:
            self.out.write("\n")


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class BulkRedrive:
    def __init__(self, session: Session, args: argparse.Namespace, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr, interactive: bool | None = None) -> None:
        self.session = session
        self.args = args
        self.out = out
        self.err = err
        self.interactive = (sys.stdin.isatty() and err.isatty()) if interactive is None else interactive
        self.report: dict[str, Any] = {"dry_run": bool(args.dry_run)}

    def _ask(self, command: str, payload: dict[str, Any], on_partial: Any = None) -> Any:
        return self.session.request(command, payload, self.args.timeout, self.args.instances, on_partial=on_partial)

    def run(self) -> int:
        filters = filters_of(self.args)
        limit = self.args.limit or 100_000
        plan = self._ask("redrive", {**filters, "limit": limit, "dry_run": True}).final
        self.report["plan"] = plan
        counts = {r["instance"]: int(r["result"].get("count") or 0) for r in _ok(plan)}
        eligible = {r["instance"]: list(r["result"].get("eligible") or []) for r in _ok(plan)}
        self.report["refused"] = _sum(plan, "refused_count")
        if self.args.dry_run or not plan or sum(counts.values()) == 0:
            return self._finish(plan, [])
        canary_ids: list[str] = []
        canary: list[dict[str, Any]] = []
        if self.args.canary:
            canary_ids = pick_canary(eligible, self.args.canary)
            canary, passed = self._canary(canary_ids, filters)
            if not passed:
                return self._finish(plan, canary, stopped=True)
            for r in _ok(canary):
                counts[r["instance"]] -= int(r["result"].get("count") or 0)
        rest: list[dict[str, Any]] = []
        if sum(counts.values()) > 0:
            rest = self._main(filters, counts, canary_ids, limit)
        return self._finish(plan, canary, rest)

    def _canary(self, ids: list[str], filters: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        sent = self._ask("redrive", {"task_ids": ids, **({"force": True} if filters.get("force") else {})})
        redriven = _sum(sent.final, "count")
        outcomes = self._await_outcomes(sent.request_id, redriven)
        ratio = outcomes["succeeded"] / redriven if redriven else 0.0
        passed = ratio >= self.args.canary_min
        self.report["canary"] = {"request_id": sent.request_id, "tasks": ids, "redriven": redriven,
                                 "outcomes": outcomes, "success_ratio": round(ratio, 3),
                                 "min": self.args.canary_min, "passed": passed}
        if outcomes["waiting"]:
            self.report["canary"]["why_undecided"] = self._held_by()
        self._say(f"canary: {redriven} redriven · {outcomes['succeeded']} succeeded · {outcomes['failed']} failed · "
                  f"{outcomes['waiting']} undecided → {ratio:.0%} (needs {self.args.canary_min:.0%}): "
                  f"{'passed' if passed else 'FAILED'}")
        if not passed and self.interactive and not self.args.json:
            passed = input("continue with the rest anyway? [y/N] ").strip().lower() in ("y", "yes")
            self.report["canary"]["continued_by_operator"] = passed
        return sent.final, passed

    def _held_by(self) -> str:
        """Why canary tasks may not have run: the queue's circuit breaker open, or the queue paused, somewhere."""
        notes = []
        for r in _ok(self._ask("stats", {}).final):
            state = r["result"].get("breakers", {}).get(self.args.queue, {}).get("state", "closed")
            if state != "closed":
                notes.append(f"{r['instance']}: the queue's circuit breaker is {state} (tasks wait for its probes)")
            if self.args.queue in r["result"].get("paused", []):
                notes.append(f"{r['instance']}: the queue is paused")
        note = "; ".join(notes) or "the tasks had not run yet (--canary-wait to wait longer)"
        self._say(f"canary: undecided tasks: {note}")
        return note

    def _await_outcomes(self, request_id: str, expected: int) -> dict[str, int]:
        """Poll where the canary's tasks are until none is undecided, or --canary-wait passed."""
        deadline = time.monotonic() + self.args.canary_wait
        outcomes = {"succeeded": 0, "failed": 0, "waiting": expected, "gone": 0}
        while expected:
            outcomes = _outcomes(self._ask("stats", {"redrive": request_id}).final)
            decided = outcomes["succeeded"] + outcomes["failed"] + outcomes["gone"]
            if decided >= expected or time.monotonic() > deadline:
                outcomes["waiting"] = max(0, expected - decided)
                break
            time.sleep(0.5)
        return outcomes

    def _main(self, filters: dict[str, Any], counts: dict[str, int], canary_ids: list[str],
              limit: int) -> list[dict[str, Any]]:
        progress = Progress(self.err, totals=dict(counts)) if self.err.isatty() and not self.args.json else None
        payload = {**filters, "limit": limit, "shares": shares_for(counts, self.args.rate),
                   **({"exclude": canary_ids} if canary_ids else {})}
        request_id = str(uuid.uuid4())
        self.report["request_id"] = request_id
        self._say(f"redriving {sum(counts.values())} tasks at {self.args.rate:g}/s (request {request_id}; Ctrl-C or "
                  f"`rdq redrive --cancel {request_id}` stops it on every instance)")
        try:
            sent = self.session.request("redrive", payload, self.args.timeout, self.args.instances,
                                        on_partial=progress, request_id=request_id)
        except KeyboardInterrupt:
            # Ctrl-C stops the redrive on every instance (at its next batch), not only this command.
            self._say(f"\ncancelling redrive {request_id}: every instance stops at its next batch…")
            self._ask("cancel", {"request_id": request_id})
            sent = self.session.collect(Replies(request_id), self.args.timeout, self.args.instances)
            self.report["cancelled"] = True
        final: list[dict[str, Any]] = sent.final
        if progress is not None:
            progress.end()
        return final

    def _finish(self, plan: list[dict[str, Any]], canary: list[dict[str, Any]],
                rest: list[dict[str, Any]] | None = None, stopped: bool = False) -> int:
        rest = rest or []
        seconds = max((float(r["result"].get("seconds") or 0) for r in _ok(rest)), default=0.0)
        summary = {"eligible": _sum(plan, "count"), "redriven": _sum(canary, "count") + _sum(rest, "count"),
                   "canary": _sum(canary, "count"), "refused": _sum(plan, "refused_count"),
                   "refused_by_reason": _reasons(plan), "seconds": round(seconds, 3),
                   "rate": round(_sum(rest, "count") / seconds, 1) if seconds else None,
                   "outcomes": _outcomes(rest), "stopped_by_canary": stopped,
                   "interrupted": [r["instance"] for r in _ok(rest) if r["result"].get("interrupted")]}
        self.report.update(summary=summary, replies=rest)
        if self.args.json:
            print(json.dumps(self.report, indent=2), file=self.out)
        else:
            print(self._text(plan, rest, summary), file=self.out)
        if stopped:
            return CANARY_FAILED
        replies = [*plan, *canary, *rest]
        if not plan:
            return 4
        return 0 if all(r.get("ok") for r in replies) else 5

    def _text(self, plan: list[dict[str, Any]], rest: list[dict[str, Any]], summary: dict[str, Any]) -> str:
        from bridge.cli.render import table

        lines = []
        if self.args.dry_run:
            lines.append(table(["INSTANCE", "WOULD REDRIVE", "REFUSED"],
                               [[r["instance"], r["result"].get("count", 0), r["result"].get("refused_count", 0)]
                                for r in _ok(plan)]))
        elif rest:
            lines.append(table(["INSTANCE", "REDRIVEN", "RATE/S", "SECONDS", "NOTE"],
                               [[r["instance"], r["result"].get("count", 0), r["result"].get("rate"),
                                 r["result"].get("seconds"), r["result"].get("interrupted") or r["result"].get("note")]
                                for r in _ok(rest)]))
        for r in plan:
            if not r.get("ok"):
                lines.append(f"{r.get('instance')}: {r['error']['type']}: {r['error']['message']}")
        what = "would redrive" if self.args.dry_run else "redriven"
        count = summary["eligible"] if self.args.dry_run else summary["redriven"]
        lines.append(f"{what}: {count}" + (f" (canary {summary['canary']})" if summary["canary"] else "")
                     + (f" at {summary['rate']}/s over {summary['seconds']}s" if summary["rate"] else ""))
        if summary["refused"]:
            reasons = ", ".join(f"{k} {v}" for k, v in summary["refused_by_reason"].items())
            lines.append(f"refused: {summary['refused']} ({reasons}; --force passes the loop guard)")
        if summary["stopped_by_canary"]:
            lines.append("stopped: the canary's success ratio was below --canary-min; the rest stay DEAD")
        elif not self.args.dry_run:
            o = summary["outcomes"]
            later = f"later: rdq stats --redrive {self.report.get('request_id')}"
            lines.append(f"outcomes so far: {o['succeeded']} succeeded · {o['failed']} failed · "
                         f"{o['waiting']} waiting · {o['gone']} gone ({later})")
        return "\n".join(lines)

    def _say(self, text: str) -> None:
        if not self.args.json:
            print(text, file=self.err, flush=True)


def _reasons(plan: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in _ok(plan):
        listed = r["result"].get("refused") or []
        for refusal in listed:
            counts[refusal["reason"]] = counts.get(refusal["reason"], 0) + 1
        unlisted = int(r["result"].get("refused_count") or 0) - len(listed)
        if unlisted > 0:
            counts["LoopGuard"] = counts.get("LoopGuard", 0) + unlisted  # the only bulk refusal
    return counts
