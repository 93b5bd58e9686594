"""The `rdq` command line (SPEC §7.6).

    rdq run --config F                      the bridge
    rdq demo                                a local broker and bridge; watch records fail, retry, dead-letter, redrive
    rdq topics | check-config --config F    create missing topics / validate a config
    rdq redrive | get | list | purge | pause | resume | set-policy | stats | breaker | skip --config F …
                                            signed commands on the admin topic; every instance answers
    rdq import --config F --topic T --queue Q    another system's DLQ → DEAD tasks, ready to redrive
    rdq dlq tail --config F --topic T       a DLQ topic, for people (or --json); --follow
    rdq store stats | list | get --db PATH  read a store file directly, for when Kafka is down
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from bridge.admin.protocol import MAX_REDRIVE_RATE
from bridge.cli.redrive import DEFAULT_RATE
from bridge.config import BridgeConfig, ConfigError, load_config
from bridge.logs import FORMATS, setup_logging
from bridge.store.database import StoreError


def _cmd_run(args: argparse.Namespace) -> int:
    from bridge.service import serve

    config = load_config(args.config)
    asyncio.run(serve(config, Path(args.config)))
    return 0


def _cmd_topics(args: argparse.Namespace) -> int:
    from bridge.kafka_clients import ensure_topics

    config = load_config(args.config)
    created = ensure_topics(config)
    print(f"created: {', '.join(created)}" if created else "all topics exist")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    print(f"{args.config}: ok ({len(config.queues)} queues: {', '.join(config.queues)})")
    return 0


# ---- admin verbs --------------------------------------------------------------------------------------------


def _policy_from(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.clear:
        return None
    policy: dict[str, Any] = json.loads(args.policy_json) if args.policy_json else {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        node = policy
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)  # numbers, booleans and lists parse; "30s" stays a string
    if not policy:
        raise ConfigError("set-policy needs --set key=value (repeatable), --policy-json or --clear")
    return policy


def _admin_args(args: argparse.Namespace) -> dict[str, Any]:
    verb = args.command
    if verb == "redrive":
        picked = {"task_id": args.task, "dry_run": args.dry_run or None, "force": args.force or None}
        return {k: v for k, v in picked.items() if v is not None}
    if verb in ("get", "skip"):
        return {"task_id": args.task_id}
    if verb == "list":
        picked = {"queue": args.queue, "status": args.status, "limit": args.limit, "error_type": args.error_type}
        return {k: v for k, v in picked.items() if v}
    if verb == "purge":
        picked = {"task_id": args.task, "queue": args.queue, "status": args.status, "before": args.before}
        return {k: v for k, v in picked.items() if v is not None}
    if verb in ("pause", "resume"):
        return {"queue": args.queue}
    if verb == "stats":
        return {"redrive": args.redrive} if args.redrive else {}
    if verb == "breaker":
        return {"queue": args.queue, "action": args.action}
    if verb == "set-policy":
        return {"queue": args.queue, "policy": _policy_from(args)}
    return {}


def _progress(reply: dict[str, Any]) -> None:
    progress = reply.get("result", {}).get("progress", {})
    print(f"\r{reply.get('instance')}: {progress.get('done')}/{progress.get('total')}", end="", file=sys.stderr,
          flush=True)


def _cmd_admin(args: argparse.Namespace) -> int:
    from bridge.admin.client import AdminSession
    from bridge.cli.render import render

    config = load_config(args.config)
    session = AdminSession(config, args.issued_by, args.key_id)
    try:
        if args.command == "redrive" and args.queue:
            from bridge.cli.redrive import BulkRedrive

            return BulkRedrive(session, args).run()
        if args.command == "redrive" and args.cancel:
            replies = session.request("cancel", {"request_id": args.cancel}, args.timeout, args.instances).final
        elif args.command == "redrive" and args.from_dlq:
            replies = _redrive_from_dlq(session, config, args)
        else:
            replies = session.request(args.command, _admin_args(args), args.timeout, args.instances,
                                      on_partial=None if args.json else _progress).final
    finally:
        session.close()
    if args.json:
        print(json.dumps(replies, indent=2))
    else:
        print(render("cancel" if getattr(args, "cancel", None) else args.command, replies))
    if not replies:
        return 4
    return 0 if all(r.get("ok") for r in replies) else 5


def _redrive_from_dlq(session: Any, config: BridgeConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Ask every instance first (a dry run: who holds the task, who would re-create it), then have exactly one
    carry it out: the holder, else `--instance`, else the owner of the task's home partition. Returns that
    instance's answer (the others refuse by design: `NotChosen`)."""
    topic, partition, offset = _dlq_ref(args.from_dlq)
    base = {"dlq": {"topic": topic, "partition": partition, "offset": offset},
            **({"force": True} if args.force else {})}
    probe: list[dict[str, Any]] = session.request("redrive", {**base, "dry_run": True}, args.timeout,
                                                  args.instances).final
    if args.dry_run or not probe:
        return probe
    holders = sorted(r["instance"] for r in probe if r.get("ok") and r["result"].get("held"))
    owners = sorted(r["instance"] for r in probe if r.get("ok") and r["result"].get("would_recreate"))
    if holders:
        target = holders[0]
    elif args.instance:
        target = args.instance
    else:  # the owner of the home partition; when nobody consumes it, the first instance by name
        target = (owners or sorted(r["instance"] for r in probe))[0]
    replies: list[dict[str, Any]] = session.request("redrive", {**base, "instance": target}, args.timeout,
                                                    args.instances).final
    return [r for r in replies if r.get("instance") == target]


def _rate(text: str) -> float:
    rate = float(text)
    if not 0 < rate <= MAX_REDRIVE_RATE:
        raise argparse.ArgumentTypeError(f"a rate is > 0 and <= {MAX_REDRIVE_RATE:g} tasks/s, not {text}")
    return rate


def _dlq_ref(text: str) -> tuple[str, int, int]:
    try:
        topic, partition, offset = text.rsplit("/", 2)
        return topic, int(partition), int(offset)
    except ValueError as e:
        raise ConfigError(f"--from-dlq wants topic/partition/offset, not {text!r}") from e


# ---- rdq import, rdq dlq tail ----------------------------------------------------------------------------


def _cmd_import(args: argparse.Namespace) -> int:
    from bridge.admin.client import AdminSession
    from bridge.cli.imports import Import

    config = load_config(args.config)
    if args.queue not in config.queues:
        raise ConfigError(f"no queue named {args.queue!r} in {args.config}")
    session = AdminSession(config, args.issued_by, args.key_id)
    try:
        return Import(session, config, args).run()
    finally:
        session.close()


def _cmd_demo(args: argparse.Namespace) -> int:
    from bridge.cli.demo import main as demo

    return demo(args.timeout)


def _cmd_dlq(args: argparse.Namespace) -> int:
    from bridge.cli.dlq_tail import tail

    return tail(load_config(args.config), args)


# ---- rdq store ----------------------------------------------------------------------------------------------


def _store_path(args: argparse.Namespace) -> Path:
    if args.db:
        return Path(args.db)
    if args.config:
        return load_config(args.config).store.path
    raise ConfigError("give --db PATH or --config F")


def _cmd_store(args: argparse.Namespace) -> int:
    from bridge.admin.loop import task_summary
    from bridge.cli.render import STATUSES, table, task_view
    from bridge.store.reader import StoreReader

    reader = StoreReader(_store_path(args))
    try:
        if args.store_command == "stats":
            counts = reader.counts()
            data: Any = {"queues": counts}
            text = table(["QUEUE", *STATUSES], [[q, *(c.get(s, 0) for s in STATUSES)] for q, c in counts.items()])
        elif args.store_command == "list":
            tasks = [task_summary(t) for t in reader.list(args.queue, args.status, args.limit, args.error_type)]
            data = {"tasks": tasks}
            text = table(["ID", "QUEUE", "STATUS", "ATT", "REDR", "ERROR", "SOURCE"],
                         [[t["id"], t["queue"], t["status"], t["attempt_count"], t["redrive_count"],
                           t["error_type"], t["source"]] for t in tasks])
        else:
            task = reader.get(args.task_id)
            if task is None:
                print(f"no task {args.task_id} in this store", file=sys.stderr)
                return 4
            data = {**task.to_json(), "attempts": [a.to_json() for a in task.attempts],
                    "redrives": reader.redrives(task.id)}
            text = task_view(data)
    finally:
        reader.close()
    print(json.dumps(data, indent=2) if args.json else text)
    return 0


# ---- the parser ---------------------------------------------------------------------------------------------


def _admin_parser(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
    parser.add_argument("--config", required=True, help="the bridge config (kafka and admin sections)")
    parser.add_argument("--json", action="store_true", help="print the replies as JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to gather replies (default 5)")
    parser.add_argument("--instances", type=int, default=None, help="stop once this many instances answered")
    parser.add_argument("--as", dest="issued_by", default=None, help="issued_by (default user@host)")
    parser.add_argument("--key-id", default=None, help="which admin.auth key signs (default signing_key or first)")
    parser.set_defaults(fn=_cmd_admin)
    return parser


def _add_admin_verbs(sub: Any) -> None:
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
    redrive.add_argument("--rate", type=_rate, default=DEFAULT_RATE, help="with --queue: tasks/s for the whole "
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
    imp.set_defaults(fn=_cmd_import)
    imp.add_argument("--topic", required=True, help="the dead-letter topic to read (every partition, all records)")
    imp.add_argument("--queue", required=True, help="the queue whose handler the tasks will run when redriven")
    imp.add_argument("--dry-run", action="store_true", help="say what would be imported and refused")
    imp.add_argument("--error-type", help="only records that failed with this exception type (fully qualified, "
                     "or the class name alone)")
    imp.add_argument("--rate", type=_rate, default=1000.0, help="records/s (default 1000)")
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
    dlq.set_defaults(fn=_cmd_dlq)


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
    store.set_defaults(fn=_cmd_store)


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
    run.set_defaults(fn=_cmd_run)
    topics = sub.add_parser("topics", help="create the config's topics that are missing")
    topics.add_argument("--config", required=True)
    topics.set_defaults(fn=_cmd_topics)
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", required=True)
    check.set_defaults(fn=_cmd_check)
    demo = sub.add_parser("demo", help="a local broker and bridge, records sent, what happens shown; then the "
                          "SRE's commands")
    demo.add_argument("--timeout", type=float, default=180.0, help="give up after this many seconds")
    demo.set_defaults(fn=_cmd_demo)
    _add_admin_verbs(sub)
    _add_dlq_verbs(sub)
    _add_store_verbs(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("INFO" if args.command == "run" and args.log_level == "WARNING" else args.log_level,
                  args.log_format)
    logging.getLogger("bridge.cli").debug("rdq %s", args.command)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"rdq: {e}", file=sys.stderr)
        return 2
    except StoreError as e:
        print(f"rdq: store: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the admin client's errors (no reply topic, broker unreachable) read as one line
        from bridge.admin.client import AdminClientError

        if isinstance(e, AdminClientError):
            print(f"rdq: {e}", file=sys.stderr)
            return 4
        raise


if __name__ == "__main__":
    sys.exit(main())
