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

import logging
import sys
from typing import Any

from bridge.cli.parser import build_parser
from bridge.config import ConfigError
from bridge.logs import setup_logging
from bridge.store.database import StoreError


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
        from confluent_kafka import KafkaException

        from bridge.admin.client import AdminClientError

        if isinstance(e, AdminClientError):
            print(f"rdq: {e}", file=sys.stderr)
            return 4
        if isinstance(e, KafkaException):  # a broker call that failed where no command says more: one line too
            print(f"rdq: kafka: {_kafka_error(e)}", file=sys.stderr)
            return 4
        raise


def _kafka_error(e: Exception) -> str:
    """A KafkaException's own message (its KafkaError's), not the error object's repr."""
    error: Any = e.args[0] if e.args else None
    return str(error.str()) if hasattr(error, "str") else str(e)


if __name__ == "__main__":
    sys.exit(main())
