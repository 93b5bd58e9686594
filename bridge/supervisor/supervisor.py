"""The supervisor of `engine.processes` bridge processes (`rdq run` when it is more than 1).

First SIGINT/SIGTERM: every child is sent SIGTERM and stops gracefully (within its stop budget, 2 grace periods
+ 25 s, after which it names and cancels what is stuck and exits 1); a child still running 5 s after its budget
is killed. A second signal kills the children and exits (130). SIGHUP is forwarded (each child reloads its
config), so is SIGQUIT (each child prints its threads' stacks). A child that dies is restarted with backoff (1 s
doubling to 30 s, back to 1 s after a run of 30 s), counted in `rdq_supervisor_restarts_total` and logged; its
partitions move to its siblings meanwhile and come back. If the supervisor itself dies, its children see their
lifeline close and stop by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path

from bridge.config import BridgeConfig, ConfigError
from bridge.config.processes import base_identity
from bridge.supervisor.children import Child
from bridge.supervisor.gateway import Gateway
from bridge.supervisor.metrics import SupervisorMetrics

log = logging.getLogger(__name__)
_KILL_AFTER_BUDGET = 5.0  # a child past its own stop budget logs what is stuck first


class Supervisor:
    def __init__(self, config: BridgeConfig, config_path: Path, count: int) -> None:
        self.config = config
        self.metrics = SupervisorMetrics()
        self.metrics.children.set(count)
        self.children = [Child(i, count, config_path, self._restarted) for i in range(count)]
        self.stopping = asyncio.Event()
        self._signals = 0
        self.gateway: Gateway | None = None  # serving once `run` bound its port

    def _restarted(self, index: int) -> None:
        self.metrics.restarts.labels(str(index)).inc()

    def _on_stop_signal(self, signum: int) -> None:
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals > 1:
            log.warning("second %s: killing %d children and exiting now", name, len(self.children))
            for child in self.children:
                child.signal(signal.SIGKILL)
            os._exit(130)
        log.info("%s: stopping %d children gracefully (again to force)", name, len(self.children))
        self.stopping.set()
        for child in self.children:
            child.signal(signal.SIGTERM)

    def _forward(self, signum: int) -> None:
        for child in self.children:
            child.signal(signal.Signals(signum))

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        loop.add_signal_handler(signal.SIGQUIT, self._forward, signal.SIGQUIT)  # each child prints its stacks

    async def _kill_stragglers(self) -> None:
        await self.stopping.wait()
        await asyncio.sleep(self.config.engine.stop_budget + _KILL_AFTER_BUDGET)
        for child in self.children:
            if child.pid is not None:
                log.error("child %d still running %.0f s after SIGTERM: killing it", child.index,
                          self.config.engine.stop_budget + _KILL_AFTER_BUDGET)
                child.signal(signal.SIGKILL)

    async def run(self) -> int:
        telemetry = self.config.telemetry
        if telemetry.port is not None:  # bound first: a taken port fails the start clearly, before any child
            listener = listen(telemetry.host, telemetry.port)
            self.gateway = Gateway(self.children, self.metrics, telemetry.host, listener.getsockname()[1])
            await self.gateway.start(listener)
        self._install_signals()
        log.info("rdq supervisor started: %d processes (instances %s-0 … -%d)", len(self.children),
                 base_identity(self.config), len(self.children) - 1)
        stragglers = asyncio.create_task(self._kill_stragglers(), name="rdq-kill-stragglers")
        try:
            await asyncio.gather(*(child.keep(self.stopping) for child in self.children))
        finally:
            stragglers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stragglers
            if self.gateway is not None:
                await self.gateway.close()
        log.info("rdq supervisor stopped")
        return 0


def listen(host: str, port: int) -> socket.socket:
    """The gateway's socket, bound before any child starts: a taken port fails the start, nothing half-served."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise ConfigError(f"telemetry: cannot listen on {host}:{port} for the supervisor's /metrics and /readyz: "
                          f"{e.strerror or e}") from None
    sock.setblocking(False)
    return sock
