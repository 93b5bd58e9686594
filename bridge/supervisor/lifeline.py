"""A child's end of its two pipes to the supervisor: the lifeline (end of file when the supervisor is gone, however
it went: SIGKILL included) and the report (what the supervisor needs to know, as JSON lines)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from bridge.config.processes import ChildSpec

log = logging.getLogger(__name__)


class Lifeline:
    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec

    def watch(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        """Stop gracefully once the supervisor is gone: a child never runs on as an orphan holding leases."""
        fd = self.spec.lifeline_fd
        if fd is None:
            return

        def readable() -> None:
            try:
                data = os.read(fd, 64)
            except OSError:
                data = b""
            if not data:  # the supervisor's end closed
                loop.remove_reader(fd)
                log.warning("the supervisor is gone: child %d stopping", self.spec.index)
                stop.set()

        loop.add_reader(fd, readable)

    def report(self, **fields: Any) -> None:
        fd = self.spec.report_fd
        if fd is None:
            return
        try:
            os.write(fd, json.dumps(fields).encode() + b"\n")
        except OSError as e:  # the supervisor is gone; the lifeline stops this child
            log.debug("cannot report to the supervisor: %s", e)
