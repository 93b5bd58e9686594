"""One child bridge process: spawned with its pipes, watched, restarted with backoff while the supervisor runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bridge.aio import first_of
from bridge.config.processes import CHILD_ENV, ChildSpec

log = logging.getLogger(__name__)

FIRST_RESTART_DELAY = 1.0
MAX_RESTART_DELAY = 30.0
HEALTHY_RUN = 30.0  # a child that ran this long before it died is restarted at once, not after a grown backoff


class Child:
    """Child `index` of `count`, running `rdq run --config <path>` with `RDQ_CHILD` saying which it is."""

    def __init__(self, index: int, count: int, config_path: Path, on_restart: Callable[[int], None]) -> None:
        self.index, self.count, self.config_path = index, count, config_path
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "starting"  # starting → running → (exited → waiting → starting …) → stopped
        self.restarts = 0
        self.health_port: int | None = None  # reported by the child once its health server listens
        self.instance_id: str | None = None
        self.delay = FIRST_RESTART_DELAY
        self._on_restart = on_restart
        self._lifeline: int | None = None  # the supervisor's end; closed when the child exits or we die
        self._reports: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    async def keep(self, stopping: asyncio.Event) -> None:
        """Run the child until the supervisor stops; restart it when it dies, with a backoff that grows while it
        keeps dying young (a crash loop takes neither the supervisor nor its siblings down)."""
        while not stopping.is_set():
            started = time.monotonic()
            try:
                await self._spawn()
            except OSError as e:  # no process at all (the interpreter gone, no memory): a death like another
                code: int | str = f"no start ({e})"
            else:
                if stopping.is_set():  # the signal came while it was being spawned: it never saw it
                    self.signal(signal.SIGTERM)
                code = await self._wait()
            if stopping.is_set():
                log.info("child %d stopped (exit %s)", self.index, code)
                break
            self.delay = FIRST_RESTART_DELAY if time.monotonic() - started >= HEALTHY_RUN else self.delay
            self.restarts += 1
            self._on_restart(self.index)
            log.error("child %d (pid %s) exited with %s; restarting in %.1f s (restart %d)", self.index,
                      self.proc.pid if self.proc else "-", code, self.delay, self.restarts)
            self.state = "waiting"
            await first_of(stopping, timeout=self.delay)
            self.delay = min(self.delay * 2, MAX_RESTART_DELAY)
        self.state = "stopped"

    async def _spawn(self) -> None:
        lifeline_read, self._lifeline = os.pipe()
        report_read, report_write = os.pipe()
        spec = ChildSpec(self.index, self.count, lifeline_fd=lifeline_read, report_fd=report_write)
        self.health_port = None
        self.state = "starting"
        try:
            # Its own session: a terminal's Ctrl-C reaches the supervisor only, which forwards one signal (two
            # would force the child out).
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bridge.cli", "run", "--config", str(self.config_path),
                env={**os.environ, CHILD_ENV: spec.to_env()}, pass_fds=(lifeline_read, report_write),
                start_new_session=True)
        except OSError:
            self.proc = None
            os.close(report_read)
            os.close(self._lifeline)
            self._lifeline = None
            raise
        finally:
            os.close(lifeline_read)
            os.close(report_write)
        self._reports = asyncio.create_task(self._read_reports(report_read), name=f"rdq-child-{self.index}-reports")
        log.info("child %d started: pid %d", self.index, self.proc.pid)

    async def _read_reports(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(fd, "rb", 0))
        try:
            while line := await reader.readline():
                with contextlib.suppress(ValueError, TypeError):
                    self._apply(json.loads(line))
        finally:
            transport.close()

    def _apply(self, report: dict[str, object]) -> None:
        if isinstance(report.get("health_port"), int):
            self.health_port = int(report["health_port"])  # type: ignore[call-overload]
        if isinstance(report.get("instance_id"), str):
            self.instance_id = str(report["instance_id"])
        if report.get("state") == "running":
            self.state = "running"

    async def _wait(self) -> int:
        assert self.proc is not None
        code = await self.proc.wait()
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self._reports is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reports, 1.0)
        self.health_port = None
        self.state = "exited"
        return code

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def status(self) -> dict[str, object]:
        return {"pid": self.pid, "state": self.state, "restarts": self.restarts, "instance_id": self.instance_id}
