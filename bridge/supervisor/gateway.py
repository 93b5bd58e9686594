"""The supervisor's one `/metrics`, `/healthz` and `/readyz` on the configured port, made of its children's.

`/metrics`: every child's series with a `process="<i>"` label (one HELP and TYPE per family; sum over `process`
in queries), and the supervisor's own (`rdq_supervisor_*`). `/readyz`: ready when every child is (a child that
is restarting, or does not answer within a second, is not). `/healthz`: the supervisor answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterable, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bridge.supervisor.children import Child
from bridge.supervisor.metrics import SupervisorMetrics

log = logging.getLogger(__name__)
_CHILD_TIMEOUT = aiohttp.ClientTimeout(total=1.0)


class _Merged:
    """A collector of parsed families (prometheus_client's text writer does the rest)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


def merge_metrics(texts: Sequence[tuple[str, str]]) -> dict[str, Metric]:
    """Families by name; each sample labelled with the process it came from."""
    merged: dict[str, Metric] = {}
    for process, text in texts:
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples.extend(Sample(s.name, {**s.labels, "process": process}, s.value, s.timestamp, s.exemplar)
                                for s in family.samples)
    return merged


class Gateway:
    def __init__(self, children: Sequence[Child], metrics: SupervisorMetrics, host: str, port: int) -> None:
        self.children = children
        self.metrics = metrics
        self.host, self.port = host, port
        self.bound_port: int | None = None
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def _get(self, child: Child, path: str) -> tuple[int, str] | None:
        if child.health_port is None or self._session is None:
            return None
        try:
            async with self._session.get(f"http://127.0.0.1:{child.health_port}{path}") as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.debug("child %d did not answer %s: %s", child.index, path, e)
            return None

    async def _metrics(self, request: web.Request) -> web.Response:
        answers = await asyncio.gather(*(self._get(c, "/metrics") for c in self.children))
        self.metrics.running.set(sum(c.pid is not None for c in self.children))
        texts = [(str(c.index), a[1]) for c, a in zip(self.children, answers, strict=True) if a and a[0] == 200]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(merge_metrics(texts).values()))
        body = generate_latest(registry) + generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _readyz(self, request: web.Request) -> web.Response:
        answers = await asyncio.gather(*(self._get(c, "/readyz") for c in self.children))
        children: dict[str, object] = {}
        for child, answer in zip(self.children, answers, strict=True):
            body: dict[str, object] = {"ready": False}
            if answer is not None:
                try:
                    body = json.loads(answer[1])
                except ValueError:
                    body = {"ready": False, "answer": answer[1][:200]}
            children[str(child.index)] = {**child.status(), **body}
        ready = all(isinstance(c, dict) and c.get("ready") is True for c in children.values())
        return web.Response(text=json.dumps({"ready": ready, "children": children}), status=200 if ready else 503,
                            content_type="application/json")

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "children": {str(c.index): c.status() for c in self.children}})

    async def start(self, listener: socket.socket) -> None:
        """Serve on the supervisor's socket, bound to the configured port before the children started."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.SockSite(self._runner, listener)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
        self._session = aiohttp.ClientSession(timeout=_CHILD_TIMEOUT)
        log.info("metrics and health of %d processes on http://%s:%s (/metrics /healthz /readyz)",
                 len(self.children), self.host, self.bound_port)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()
