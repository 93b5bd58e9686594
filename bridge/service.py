"""`rdq run`: the bridge as a service. Wires the parts, handles signals, stops gracefully (SPEC §4.9).

First SIGINT/SIGTERM: stop consuming and claiming, let running handlers finish within the grace period,
release the leases still held, close the store. A second signal forces exit. SIGHUP reloads the config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from bridge.config import BridgeConfig
from bridge.engine import Engine
from bridge.kafka_clients import broker_reachable
from bridge.live_config import LiveConfig
from bridge.registry import Registry, load_handler_modules
from bridge.store import Store

log = logging.getLogger(__name__)


def _install_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, live: LiveConfig) -> None:
    def on_stop(signum: int) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(130)
        log.info("%s: stopping gracefully (again to force)", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop, sig)
    loop.add_signal_handler(signal.SIGHUP, live.reload)


def check_handlers(config: BridgeConfig, registry: Registry) -> None:
    for name, queue in config.queues.items():
        if queue.handler not in registry:
            # Not fatal: its records become DEAD rdq.Unroutable, visible and redrivable once deployed.
            log.error("queue %s names handler %r, which is not registered (known: %s)", name, queue.handler,
                      ", ".join(registry.names()), extra={"queue": name})


async def serve(config: BridgeConfig, config_path: Path | None = None, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    live = LiveConfig(config, config_path)
    registry = load_handler_modules(config.engine.handler_modules)
    check_handlers(config, registry)
    store = await Store.open(config.store.path, config.store.synchronous, config.store.busy_timeout,
                             config.store.group_commit_max)
    engine = Engine(store, live, registry)
    _install_signals(asyncio.get_running_loop(), stop, live)
    reachable = await asyncio.to_thread(broker_reachable, config)
    log.info("rdq bridge %s started: store %s, kafka %s (%s), queues %s", engine.instance_id, store.path,
             config.kafka.bootstrap_servers, "reachable" if reachable else "not reachable yet",
             ", ".join(config.queues), extra={"instance": engine.instance_id})
    try:
        await engine.run(stop)
    finally:
        engine.close()
        await asyncio.shield(store.close())
        log.info("rdq bridge %s stopped", engine.instance_id)
