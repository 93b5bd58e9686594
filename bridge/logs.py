"""Logs for machines and for people: one JSON object per line (the default when stderr is not a terminal), or
one readable line (the default on a terminal); `--log-format json|text` chooses. Either carries the task id and
queue when the record has them. librdkafka's own logs arrive here too (logger `rdq.kafka`)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_EXTRA_FIELDS = ("task_id", "queue", "attempt", "outcome", "topic", "partition", "offset", "instance", "child")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in _EXTRA_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`20:26:56.446 INFO  bridge.service  rdq bridge vm-1 started …  task_id=… queue=…`"""

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        fields = " ".join(f"{name}={record.__dict__[name]}" for name in _EXTRA_FIELDS
                          if record.__dict__.get(name) is not None)
        line = f"{clock} {record.levelname:<7} {record.name}  {record.getMessage()}"
        if fields:
            line += f"  {fields}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


FORMATS = ("json", "text")


def setup_logging(level: str = "INFO", fmt: str | None = None) -> None:
    """`fmt`: "json", "text", or None for text on a terminal and JSON otherwise."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt is None:
        fmt = "text" if sys.stderr.isatty() else "json"
    handler.setFormatter(TextFormatter() if fmt == "text" else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def tag_child(index: int) -> None:
    """Under a supervisor (`engine.processes`) the children share its stderr: each of a child's lines says which
    child wrote it (`"child": i`)."""

    def tag(record: logging.LogRecord) -> bool:
        record.child = index
        return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(tag)
