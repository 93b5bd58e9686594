"""The `rdq` command line (SPEC §7.6)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from bridge.config import ConfigError, load_config
from bridge.logs import setup_logging
from bridge.store import StoreError


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rdq", description="rdq-bridge: a Kafka sidecar that never loses failed work")
    parser.add_argument("--log-level", default="INFO")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
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


if __name__ == "__main__":
    sys.exit(main())
