"""`/metrics` (Prometheus), `/healthz` and `/readyz` on a local port (SPEC §9).

Ready means: the broker answers a metadata request, the store can be written, the consumer group gave this
instance its first assignment (none is one: an idle member) and no assigned partition is restoring. Not ready
while any is not true; it turns ready again by itself. A rolling deploy moves on once a new pod is ready: ready
before its member joined, the next old pod would go while this one has not taken its share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

from aiohttp import web
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bridge.store.database import StoreError
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)
_PROBE_INTERVAL = 2.0
_BROKER_TIMEOUT = 2.0


class HealthServer:
    def __init__(self, telemetry: Telemetry, store: Store, admin_factory: Callable[[], AdminClient], host: str,
                 port: int, store_writable: Callable[[], bool] | None = None,
                 queues: Callable[[], list[str]] | None = None,
                 restoring: Callable[[], set[str]] | None = None,
                 joined: Callable[[], bool] | None = None,
                 breakers: Callable[[], dict[str, str]] | None = None) -> None:
        self.telemetry = telemetry
        self.store = store
        self.host = host
        self.port = port
        self._admin_factory = admin_factory
        self._store_writable = store_writable or (lambda: True)
        self._queues = queues or (lambda: [])
        self._restoring = restoring or (lambda: set())  # partitions restoring from their changelog
        self._joined = joined or (lambda: True)  # the consumer group gave this instance its first assignment
        # Queues' circuit breakers, shown but not part of readiness: an open breaker is the downstream's outage,
        # and an unready bridge would be restarted or taken out of service for it.
        self._breakers = breakers or (lambda: {})
        self.broker_ok = False
        self.bound_port: int | None = None
        self.listening = asyncio.Event()

    @property
    def store_ok(self) -> bool:
        return self.store.writable and self._store_writable()

    @property
    def ready(self) -> bool:
        return self.broker_ok and self.store_ok and self._joined() and not self._restoring()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.telemetry.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready = self.ready  # read once: the body and the status say the same
        body = {"ready": ready, "broker": self.broker_ok, "store": self.store_ok, "joined": self._joined(),
                "restoring": sorted(self._restoring()), "breakers": self._breakers()}
        return web.Response(text=json.dumps(body), status=200 if ready else 503, content_type="application/json")

    async def run(self, stop: asyncio.Event) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        server = site._server  # the bound socket: the port when 0 was asked for
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
        self.listening.set()
        log.info("metrics and health on http://%s:%s (/metrics /healthz /readyz)", self.host, self.bound_port)
        admin = await asyncio.to_thread(self._admin_factory)
        try:
            while not stop.is_set():
                await self._probe(admin)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), _PROBE_INTERVAL)
        finally:
            await runner.cleanup()

    async def _probe(self, admin: AdminClient) -> None:
        try:
            await asyncio.to_thread(admin.list_topics, timeout=_BROKER_TIMEOUT)
            self.broker_ok = True
        except KafkaException:
            self.broker_ok = False
        metrics = self.telemetry.metrics
        metrics.ready.set(1 if self.ready else 0)
        try:
            counts = await self.store.open_counts()
        except StoreError:
            return
        metrics.open_tasks.clear()
        for queue in set(self._queues()) | set(counts):  # configured queues show 0, not nothing
            for status in ("PENDING", "IN_FLIGHT", "PARKED"):
                metrics.open_tasks.labels(queue, status).set(counts.get(queue, {}).get(status, 0))
        try:
            parked = await self.store.parked_stats()
        except StoreError:
            return
        now_ms = time.time() * 1000
        metrics.parked_oldest.clear()
        for queue in set(self._queues()) | set(parked):
            oldest = parked.get(queue, (0, now_ms))[1]
            metrics.parked_oldest.labels(queue).set(max(0.0, (now_ms - oldest) / 1000))
