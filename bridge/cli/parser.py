"""The `rdq` parser: every verb, its arguments and help, and which command runs it."""

from __future__ import annotations

import argparse
from typing import Any

from bridge.cli.commands import (
    cmd_admin,
    cmd_check,
    cmd_console,
    cmd_demo,
    cmd_dlq,
    cmd_import,
    cmd_run,
    cmd_store,
    cmd_topics,
    processes,
    rate,
)
from bridge.cli.redrive import DEFAULT_RATE
from bridge.logs import FORMATS


def _admin_parser(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
    parser.add_argument("--config", required=True, help="the bridge config (kafka and admin sections)")
    parser.add_argument("--json", action="store_true", help="print the replies as JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to gather replies (default 5)")
    parser.add_argument("--instances", type=int, default=None, help="stop once this many instances answered")
    parser.add_argument("--as", dest="issued_by", default=None, help="issued_by (default user@host)")
    parser.add_argument("--key-id", default=None, help="which admin.auth key signs (default signing_key or first)")
    parser.set_defaults(fn=cmd_admin)
    return parser


def _add_redrive(sub: Any) -> None:
    redrive = _admin_parser(sub, "redrive", "DEAD → PENDING: by task id, by queue with filters, or from a DLQ record")
    target = redrive.add_mutually_exclusive_group(required=True)
    target.add_argument("--task", help="a task id")
    target.add_argument("--queue", help="every DEAD task of a queue matching the filters")
    target.add_argument("--from-dlq", help="topic/partition/offset of a DLQ record (works after a purge)")
    target.add_argument("--cancel", metavar="REQUEST_ID", help="stop a bulk redrive under way on every instance "
                        "(Ctrl-C on the redrive does this too); what it redrove stays redriven")
    redrive.add_argument("--error-type", help="the dead reason's type, module-qualified or by class name alone "
                         "(TransientError matches handlers.examples.TransientError)")
    redrive.add_argument("--since", help="dead since (RFC 3339)")
    redrive.add_argument("--until", help="dead until (RFC 3339)")
    redrive.add_argument("--limit", type=int, default=None, help="with --queue: at most this many per instance "
                         "(default: all matched, up to 100,000 per instance)")
    redrive.add_argument("--dry-run", action="store_true", help="say what would be redriven and refused; change "
                         "nothing")
    redrive.add_argument("--rate", type=rate, default=DEFAULT_RATE, help="with --queue: tasks/s for the whole "
                         f"group, shared by the instances in proportion to their tasks (default {DEFAULT_RATE:g})")
    redrive.add_argument("--canary", type=int, default=0, metavar="N", help="with --queue: redrive N tasks first, wait "
                         "for their outcome, go on only if their success ratio reaches --canary-min")
    redrive.add_argument("--canary-min", type=float, default=0.9, help="the canary's success ratio to go on (0-1, "
                         "default 0.9); below it the rest stay DEAD (on a terminal you are asked)")
    redrive.add_argument("--canary-wait", type=float, default=60.0, help="seconds to wait for the canary's "
                         "outcome (default 60); undecided tasks count as not succeeded")
    redrive.add_argument("--force", action="store_true", help="pass the loop guard: redrive tasks already redriven "
                         "max_redrives times (a queue setting, default 5)")
    redrive.add_argument("--instance", help="with --from-dlq: which instance re-creates a purged task")


def _add_admin_verbs(sub: Any) -> None:
    _add_redrive(sub)
    get = _admin_parser(sub, "get", "a task with its whole attempt history")
    get.add_argument("task_id")
    skip = _admin_parser(sub, "skip", "ordering: key — a dead task holding its key (on_dead: hold) lets the "
                         "key's next record run")
    skip.add_argument("task_id")
    listing = _admin_parser(sub, "list", "tasks of a queue and status")
    listing.add_argument("--queue")
    listing.add_argument("--status", choices=["PENDING", "IN_FLIGHT", "PARKED", "SUCCEEDED", "DEAD"])
    listing.add_argument("--limit", type=int, default=None)
    listing.add_argument("--error-type", help="the dead reason's type, module-qualified or by class name alone")
    purge = _admin_parser(sub, "purge", "delete finished tasks (never a DEAD one not yet in the DLQ)")
    target = purge.add_mutually_exclusive_group(required=True)
    target.add_argument("--task")
    target.add_argument("--queue")
    purge.add_argument("--status", choices=["SUCCEEDED", "DEAD"])
    purge.add_argument("--before", help="finished before (RFC 3339)")
    for verb, text in (("pause", "stop consuming and scheduling a queue"), ("resume", "undo pause")):
        _admin_parser(sub, verb, text).add_argument("queue")
    policy = _admin_parser(sub, "set-policy", "override a queue's retry policy (persisted; queued tasks obey)")
    policy.add_argument("queue")
    policy.add_argument("--set", action="append", metavar="KEY=VALUE", help="e.g. max_attempts=8, backoff.base=2s")
    policy.add_argument("--policy-json", help='e.g. {"max_attempts": 8}')
    policy.add_argument("--clear", action="store_true", help="back to the config file's policy")
    stats = _admin_parser(sub, "stats", "counts by queue and status, from every instance")
    stats.add_argument("--redrive", metavar="REQUEST_ID", help="instead: where the tasks of that redrive are now")
    breaker = _admin_parser(sub, "breaker", "a queue's circuit breaker: hold it open (an outage), close it, or ask")
    breaker.add_argument("action", choices=["open", "close", "status"])
    breaker.add_argument("queue")


def _add_dlq_verbs(sub: Any) -> None:
    imp = _admin_parser(sub, "import", "another system's dead-letter topic → DEAD tasks of a queue (Spring Kafka, "
                        "Kafka Connect, share groups, rdq)")
    imp.set_defaults(fn=cmd_import)
    imp.add_argument("--topic", required=True, help="the dead-letter topic to read (every partition, all records)")
    imp.add_argument("--queue", required=True, help="the queue whose handler the tasks will run when redriven")
    imp.add_argument("--dry-run", action="store_true", help="say what would be imported and refused")
    imp.add_argument("--error-type", help="only records that failed with this exception type (fully qualified, "
                     "or the class name alone)")
    imp.add_argument("--rate", type=rate, default=1000.0, help="records/s (default 1000)")
    imp.add_argument("--instance", help="without a changelog: the instance that keeps the tasks (default: the "
                     "first by name)")
    dlq = sub.add_parser("dlq", help="read a dead-letter topic")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    tail = dlq_sub.add_parser("tail", help="each record for a person: task, queue, reason, attempts, source, trace")
    tail.add_argument("--config", required=True, help="the bridge config (its kafka section)")
    tail.add_argument("--topic", required=True)
    tail.add_argument("--json", action="store_true", help="one JSON object per record and line")
    tail.add_argument("--follow", "-f", action="store_true", help="keep reading new records until Ctrl-C")
    tail.add_argument("--last", type=int, default=None, metavar="N", help="start N records before each "
                      "partition's end (default: from the beginning)")
    dlq.set_defaults(fn=cmd_dlq)


def _add_store_verbs(sub: Any) -> None:
    store = sub.add_parser("store", help="read a store file directly (read-only; Kafka not needed)")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    for name in ("stats", "list", "get"):
        p = store_sub.add_parser(name)
        p.add_argument("--db", help="the store file")
        p.add_argument("--config", help="or the config naming it")
        p.add_argument("--json", action="store_true")
        if name == "list":
            p.add_argument("--queue")
            p.add_argument("--status", choices=["PENDING", "IN_FLIGHT", "PARKED", "SUCCEEDED", "DEAD"])
            p.add_argument("--limit", type=int, default=100)
            p.add_argument("--error-type", help="the dead reason's type, module-qualified or by class name alone")
        if name == "get":
            p.add_argument("task_id")
    store.set_defaults(fn=cmd_store)


def _add_console(sub: Any) -> None:
    console = sub.add_parser("console", help="the SRE's console: a local web app (an admin client like this CLI); "
                             "prints its login URL")
    console.add_argument("--config", required=True, help="the bridge config (kafka and admin sections)")
    console.add_argument("--port", type=int, default=8089, help="default 8089 (0: any free port)")
    console.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    console.add_argument("--name", default=None, help="issued_by is console:NAME (default: the OS user)")
    console.add_argument("--key-id", default=None, help="which admin.auth key signs (default signing_key or first)")
    console.add_argument("--trace-url", default=None, metavar="TEMPLATE",
                         help="a trace UI's URL with {trace_id}, e.g. http://jaeger:16686/trace/{trace_id}: a "
                         "task's traceparent becomes a link")
    console.set_defaults(fn=cmd_console)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rdq", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING", help="for `rdq run` the default is INFO")
    parser.add_argument("--log-format", choices=FORMATS, default=None,
                        help="json (one object per line) or text (one readable line); default: text on a terminal, "
                        "json otherwise")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the bridge")
    run.add_argument("--config", required=True)
    run.add_argument("--processes", type=processes, default=None, metavar="N|auto",
                     help="bridge processes under one supervisor (default: engine.processes, 1)")
    run.set_defaults(fn=cmd_run)
    topics = sub.add_parser("topics", help="create the config's topics that are missing")
    topics.add_argument("--config", required=True)
    topics.set_defaults(fn=cmd_topics)
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", required=True)
    check.set_defaults(fn=cmd_check)
    demo = sub.add_parser("demo", help="a local broker and bridge, records sent, what happens shown; then the "
                          "SRE's commands")
    demo.add_argument("--timeout", type=float, default=180.0, help="give up after this many seconds")
    demo.set_defaults(fn=cmd_demo)
    _add_console(sub)
    _add_admin_verbs(sub)
    _add_dlq_verbs(sub)
    _add_store_verbs(sub)
    return parser
