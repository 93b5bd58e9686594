"""`rdq run`: the bridge as a service. Wires the parts, handles signals, stops gracefully (SPEC §4.9).

Data flows one way: source record → first delivery (handler) → store → scheduler → DLQ publisher.
First SIGINT/SIGTERM: stop consuming and claiming, let running handlers finish within the grace period,
release the leases still held, commit offsets, close the store. A second signal forces exit.
SIGHUP reloads the config (so does a change of the file).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
from pathlib import Path

from confluent_kafka import Producer

from bridge.admin.commands import AdminCommands
from bridge.admin.loop import AdminLoop
from bridge.aio import Backoff
from bridge.changelog.decoder import PROCESS_FROM
from bridge.changelog.local import LocalIndex
from bridge.changelog.restore import Restorer
from bridge.changelog.topics import ChangelogTopicError, ensure_changelogs
from bridge.changelog.writer import ChangelogWriter
from bridge.config import BridgeConfig
from bridge.config.processes import ChildSpec, core_to_spare
from bridge.dlq.publisher import DlqPublisher
from bridge.engine.core import Engine, default_instance_id, supervise
from bridge.hooks import Hooks
from bridge.kafka_clients import (
    broker_reachable,
    dlq_batch_bytes,
    make_admin,
    make_admin_consumer,
    make_changelog_producer,
    make_consumer,
    make_dlq_producer,
    make_producer,
    make_restore_consumer,
    partition_count,
    read_range,
    read_record,
    topic_max_message_bytes,
)
from bridge.live_config import LiveConfig
from bridge.logs import tag_child
from bridge.memory import tune_gc
from bridge.model import new_task_id
from bridge.registry import Registry, load_handler_modules
from bridge.source.consumer import SourceConsumer
from bridge.source.first_delivery import FirstDelivery
from bridge.source.restores import Changelog
from bridge.store.tasks import Store
from bridge.supervisor.lifeline import Lifeline
from bridge.telemetry.core import Telemetry
from bridge.telemetry.health import HealthServer
from bridge.workers.http_handler import HttpHandler
from bridge.workers.server import WorkerServer

log = logging.getLogger(__name__)


def _install_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, live: LiveConfig) -> None:
    received = 0  # signals, not `stop`: a stop begun by the bridge itself still gets a graceful first signal

    def on_stop(signum: int) -> None:
        nonlocal received
        received += 1
        if received > 1:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(130)
        log.info("%s: stopping gracefully (again to force)", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop, sig)
    loop.add_signal_handler(signal.SIGHUP, live.reload_soon)
    # `kill -QUIT` prints every thread's stack to stderr and the bridge runs on (as a JVM does): a bridge that
    # will not stop can be asked where it is stuck. faulthandler writes from the C handler, so it answers even
    # when the event loop or the GIL is held.
    faulthandler.register(signal.SIGQUIT, all_threads=True, chain=False)


def check_handlers(config: BridgeConfig, registry: Registry) -> None:
    for name, queue in config.queues.items():
        if queue.http is None and queue.handler not in registry:  # an `http:` queue's handler is made from it
            # Not fatal: its records become DEAD rdq.Unroutable, visible and redrivable once deployed.
            log.error("queue %s names handler %r, which is not registered (known: %s)", name, queue.handler,
                      ", ".join(registry.names()), extra={"queue": name})


class Bridge:
    """Every part of a running bridge, built from one config in dependency order: each part is given what it
    uses when it is built; what one part tells another goes through `hooks` (bridge/hooks.py)."""

    def __init__(self, config: BridgeConfig, store: Store, registry: Registry, config_path: Path | None = None,
                 instance_id: str | None = None, telemetry: Telemetry | None = None,
                 changelog_topics: dict[str, str] | None = None) -> None:
        self.config = config
        self.store = store
        self.live = LiveConfig(config, config_path)
        self.hooks = Hooks()
        self.http_handlers = {q.handler: HttpHandler(q.http) for q in config.queues.values() if q.http is not None}
        registry = registry.extended(dict(self.http_handlers))
        instance_id = instance_id or config.engine.instance_id or default_instance_id()
        self.telemetry = telemetry or Telemetry(config.telemetry, group_id=config.kafka.group_id,
                                                instance_id=instance_id)
        self.engine = Engine(store, self.live, registry, instance_id=instance_id, telemetry=self.telemetry,
                             hooks=self.hooks)
        self.run_id = f"{self.engine.instance_id}-{new_task_id()}"
        self.delivery = FirstDelivery(store, self.live, registry, self.engine.clock, self.engine.threads,
                                      self.engine.instance_id, hooks=self.hooks, telemetry=self.telemetry)
        self.changelog = self._changelog(changelog_topics) if changelog_topics is not None else None
        self.consumer = SourceConsumer(config, self.live, self.delivery, store, self.run_id, self.engine.clock,
                                       lambda: make_consumer(config), config.engine.grace_period,
                                       paused_queues=self.engine.scheduler.held_queues, changelog=self.changelog)
        self.hooks.store_health.subscribe(self.consumer.set_store_health)
        self.hooks.before_redrive.subscribe(self.consumer.block_order_keys)
        self.dlq = DlqPublisher(store, config, lambda batch: make_dlq_producer(config, batch),
                                lambda: make_admin(config), self.engine.clock, self.engine.dead_event,
                                telemetry=self.telemetry,
                                changelog=self.changelog.writer if self.changelog is not None else None)
        self.admin = self._admin() if config.admin is not None else None
        self.workers = WorkerServer(config.workers, self.engine) if config.workers is not None else None
        self.health = self._health() if config.telemetry.port is not None else None

    def _changelog(self, topics: dict[str, str]) -> Changelog:
        config, instance = self.config, self.engine.instance_id
        spare = core_to_spare(os.environ)  # a core for a helper process (config/processes.py)
        local = LocalIndex(self.store, outbox_process=spare)

        def producer() -> Producer:  # its transactions carry DLQ records too
            limits = [topic_max_message_bytes(make_admin(config), config.dlq_topic(q)) for q in config.queues]
            return make_changelog_producer(config, dlq_batch_bytes(limits))

        writer = ChangelogWriter(local, topics, producer, lambda: self.consumer.commit_positions(),
                                 lambda: self.consumer.group_metadata(), self.engine.clock,
                                 config.store.changelog_commit_interval, self.telemetry,
                                 lambda: self.consumer.writable())
        self.hooks.claim_logged = lambda task, timeout: writer.logged(task.id, timeout)
        # A large restore decodes in a process of its own only where a core is to spare (decoder.py).
        restorer = Restorer(local, topics, lambda: make_restore_consumer(config, instance), self.engine.clock,
                            lambda: make_restore_consumer(config, instance, committed_only=False),
                            process_from=PROCESS_FROM if spare else None,
                            probe_factory=lambda: make_restore_consumer(config, instance, probe=True))

        async def ensure_topics() -> dict[str, str]:
            # A source topic created after the start: its changelog too (the writer and restorer share `topics`).
            found = await asyncio.to_thread(ensure_changelogs, config, make_admin(config), 10.0)
            topics.update(found)
            await local.set_changelogged(topics)
            return topics

        return Changelog(local, writer, restorer, self.engine.scheduler.hand_over, self.telemetry, ensure_topics,
                         self.engine.scheduler.wake)

    def _admin(self) -> AdminLoop:
        config = self.config
        assert config.admin is not None
        changelog = self.changelog is not None
        commands = AdminCommands(self.engine, lambda t, p, o: read_record(config, t, p, o), self.consumer.owns,
                                 self.consumer.changelog_status if changelog else None,
                                 (lambda topic: partition_count(config, topic)) if changelog else None,
                                 lambda t, p, start, end: read_range(config, t, p, start, end))
        return AdminLoop(config.admin, commands, self.engine.instance_id,
                         lambda: make_admin_consumer(config, self.run_id), lambda: make_producer(config),
                         self.engine.clock.now_ms)

    def _health(self) -> HealthServer:
        config = self.config
        assert config.telemetry.port is not None
        breakers = self.engine.scheduler.breakers
        return HealthServer(self.telemetry, self.store, lambda: make_admin(config), config.telemetry.host,
                            config.telemetry.port, store_writable=lambda: self.consumer.store_healthy,
                            queues=self.live.queue_names,
                            restoring=lambda: {f"{t}/{p}" for t, p in self.consumer.restoring},
                            joined=lambda: self.consumer.joined,
                            breakers=lambda: {q: b["state"] for q, b in breakers.status().items()})

    async def run(self, stop: asyncio.Event) -> None:
        parts = [
            *self.engine.parts(stop),
            asyncio.create_task(self.consumer.run(stop), name="rdq-consumer"),
            asyncio.create_task(self.dlq.run(stop), name="rdq-dlq"),
            asyncio.create_task(self.engine.scheduler.breakers.run(stop), name="rdq-breakers"),
        ]
        if self.admin is not None:
            parts.append(asyncio.create_task(self.admin.run(stop), name="rdq-admin"))
        if self.health is not None:
            parts.append(asyncio.create_task(self.health.run(stop), name="rdq-health"))
        if self.workers is not None:
            parts.append(asyncio.create_task(self.workers.run(stop), name="rdq-workers"))
        if self.changelog is not None:
            parts.append(asyncio.create_task(self.changelog.writer.run(stop), name="rdq-changelog"))
        try:
            await supervise(parts, stop, self.config.engine.stop_budget)
        finally:
            if self.changelog is not None:
                await self.changelog.writer.close()
            for handler in self.http_handlers.values():
                await handler.close()
            self.engine.close()
            self.telemetry.shutdown()


async def open_bridge(config: BridgeConfig, registry: Registry, config_path: Path | None = None,
                      instance_id: str | None = None, telemetry: Telemetry | None = None,
                      stop: asyncio.Event | None = None) -> Bridge:
    """The store opened as the config says (scoped to owned partitions with the changelog) and the bridge on it."""
    store = await Store.open(config.store.path, config.store.synchronous, config.store.busy_timeout,
                             config.store.group_commit_max, scoped=config.store.changelog)
    try:
        if config.store.max_size_mb is not None:
            await store.limit_size(int(config.store.max_size_mb * 2**20))
        topics = await changelog_topics(config, stop or asyncio.Event()) if config.store.changelog else None
        if topics is not None:
            await LocalIndex(store).set_changelogged(topics)
        return Bridge(config, store, registry, config_path, instance_id, telemetry, changelog_topics=topics)
    except BaseException:
        await store.close()  # its threads would keep a failed start from exiting
        raise


async def changelog_topics(config: BridgeConfig, stop: asyncio.Event) -> dict[str, str]:
    """The changelog topic of each source topic, created when missing and checked (SPEC §10). Waits for the
    broker; a changelog that exists but is wrong refuses the start (ChangelogTopicError)."""
    backoff = Backoff(0.5, 5.0)
    while True:
        try:
            return await asyncio.to_thread(ensure_changelogs, config, make_admin(config), 10.0)
        except ChangelogTopicError:
            raise
        except Exception as e:  # KafkaException: the broker is not reachable (yet)
            if stop.is_set():
                raise
            log.warning("cannot check the changelog topics yet (the broker?); retrying: %s", e)
            await backoff.sleep()


async def serve(config: BridgeConfig, config_path: Path | None = None, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    tune_gc()  # this process is a bridge's own (`rdq run`, a child of the supervisor)
    registry = load_handler_modules(config.engine.handler_modules)
    check_handlers(config, registry)
    child = ChildSpec.from_env(os.environ)
    lifeline = Lifeline(child) if child is not None else None
    if lifeline is not None:  # under a supervisor: stop when it is gone, before the start too
        lifeline.watch(asyncio.get_running_loop(), stop)
        tag_child(lifeline.spec.index)
    bridge = await open_bridge(config, registry, config_path, stop=stop)
    store = bridge.store
    _install_signals(asyncio.get_running_loop(), stop, bridge.live)
    reporting = asyncio.create_task(_report(lifeline, bridge)) if lifeline is not None else None
    reachable = await asyncio.to_thread(broker_reachable, config)
    log.info("rdq bridge %s started: store %s, kafka %s (%s), queues %s", bridge.engine.instance_id, store.path,
             config.kafka.bootstrap_servers, "reachable" if reachable else "not reachable yet",
             ", ".join(config.queues), extra={"instance": bridge.engine.instance_id})
    try:
        await bridge.run(stop)
    finally:
        if reporting is not None:
            reporting.cancel()
        await asyncio.shield(store.close())
        log.info("rdq bridge %s stopped", bridge.engine.instance_id)


async def _report(lifeline: Lifeline, bridge: Bridge) -> None:
    """Tell the supervisor who this child is and, once it listens, where its health server is."""
    lifeline.report(instance_id=bridge.engine.instance_id, state="running")
    if bridge.health is not None:
        await bridge.health.listening.wait()
        lifeline.report(health_port=bridge.health.bound_port)
