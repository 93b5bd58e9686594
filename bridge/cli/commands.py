"""What each `rdq` verb does (the parser, parser.py, maps a verb to one of these)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from bridge.admin.protocol import MAX_REDRIVE_RATE
from bridge.config import BridgeConfig, ConfigError, load_config
from bridge.config.processes import ChildSpec, process_count


def cmd_run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.processes is not None:
        config = config.model_copy(update={"engine": config.engine.model_copy(update={"processes": args.processes})})
    count = process_count(config)
    if count > 1 and ChildSpec.from_env(os.environ) is None:
        from bridge.supervisor.supervisor import Supervisor

        return asyncio.run(Supervisor(config, Path(args.config), count).run())
    asyncio.run(_serve_to_the_end(config, Path(args.config)))
    return 0


async def _serve_to_the_end(config: BridgeConfig, path: Path) -> None:
    from bridge.engine.core import StopOverran
    from bridge.service import serve

    try:
        await serve(config, path)
    except StopOverran as e:
        # Logged with each stuck part's stack, the store closed. A thread still blocked in a client call would
        # keep asyncio.run (its executor's shutdown) and the interpreter from ever exiting: exit now.
        logging.getLogger("bridge.cli").error("graceful stop overran: %s; exiting", e)
        logging.shutdown()
        os._exit(1)


def cmd_topics(args: argparse.Namespace) -> int:
    from bridge.kafka_clients import ensure_topics

    config = load_config(args.config)
    created = ensure_topics(config)
    print(f"created: {', '.join(created)}" if created else "all topics exist")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    print(f"{args.config}: ok ({len(config.queues)} queues: {', '.join(config.queues)})")
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    from bridge.console.app import serve

    config = load_config(args.config)
    if config.admin is None:
        raise ConfigError("the configuration has no `admin` section (topic, reply_topic, auth): the console is an "
                          "admin client")
    if args.trace_url is not None and "{trace_id}" not in args.trace_url:
        raise ConfigError("--trace-url must contain {trace_id}")
    asyncio.run(serve(config, args.port, args.bind, args.name, args.key_id, args.trace_url))
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


def cmd_admin(args: argparse.Namespace) -> int:
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
    topic, partition, offset = dlq_ref(args.from_dlq)
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


def rate(text: str) -> float:
    rate = float(text)
    if not 0 < rate <= MAX_REDRIVE_RATE:
        raise argparse.ArgumentTypeError(f"a rate is > 0 and <= {MAX_REDRIVE_RATE:g} tasks/s, not {text}")
    return rate


def processes(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= 256:
        raise argparse.ArgumentTypeError(f"processes is a number from 1 to 256 or auto, not {text!r}")
    return count


def dlq_ref(text: str) -> tuple[str, int, int]:
    try:
        topic, partition, offset = text.rsplit("/", 2)
        return topic, int(partition), int(offset)
    except ValueError as e:
        raise ConfigError(f"--from-dlq wants topic/partition/offset, not {text!r}") from e


# ---- rdq import, rdq dlq tail ----------------------------------------------------------------------------


def cmd_import(args: argparse.Namespace) -> int:
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


def cmd_demo(args: argparse.Namespace) -> int:
    from bridge.cli.demo import main as demo

    return demo(args.timeout)


def cmd_dlq(args: argparse.Namespace) -> int:
    from bridge.cli.dlq_tail import tail

    return tail(load_config(args.config), args)


# ---- rdq store ----------------------------------------------------------------------------------------------


def _store_path(args: argparse.Namespace) -> Path:
    if args.db:
        return Path(args.db)
    if args.config:
        return load_config(args.config).store.path
    raise ConfigError("give --db PATH or --config F")


def cmd_store(args: argparse.Namespace) -> int:
    from bridge.admin.commands import task_summary
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
