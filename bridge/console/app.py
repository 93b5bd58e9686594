"""`rdq console`: the routes, the server, the one line it prints (the login URL)."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import signal
import sys
from importlib import resources
from typing import TextIO

from aiohttp import web

from bridge.config import BridgeConfig
from bridge.console.actions import Actions
from bridge.console.admin import ConsoleAdmin
from bridge.console.gate import Gate
from bridge.console.jobs import Jobs
from bridge.console.pages import Pages
from bridge.console.site import Site


def issuer(name: str | None) -> str:
    """`issued_by` of every command the console sends: `console:<name>` (default: the OS user)."""
    if not name:
        try:
            name = getpass.getuser()
        except Exception:  # no user name in this environment
            name = "unknown"
    return f"console:{name}"


def build(site: Site) -> web.Application:
    pages, actions = Pages(site), Actions(site)
    app = web.Application(middlewares=[site.gate.middleware], client_max_size=1024 * 1024)
    app.router.add_get("/", pages.overview)
    app.router.add_get("/dead", pages.dead)
    app.router.add_get("/task/{task_id}", pages.task)
    app.router.add_post("/task/{task_id}/redrive", actions.redrive_task)
    app.router.add_get("/confirm/{action}", pages.confirm)
    app.router.add_post("/purge", actions.purge)
    app.router.add_post("/skip", actions.skip)
    app.router.add_get("/redrive", pages.redrive)
    app.router.add_post("/redrive/plan", actions.plan)
    app.router.add_post("/redrive/start", actions.start)
    app.router.add_get("/jobs", pages.jobs)
    app.router.add_get("/jobs/{job_id}.json", pages.job)  # before /jobs/{job_id}, which would match it too
    app.router.add_get("/jobs/{job_id}", pages.job)
    app.router.add_post("/jobs/{job_id}/cancel", actions.cancel)
    app.router.add_post("/queue/{queue}/{action}", actions.queue)
    app.router.add_get("/import", pages.imports)
    app.router.add_post("/import", actions.imports)
    app.router.add_get("/audit", pages.audit)
    app.router.add_static("/static/", str(resources.files("bridge.console") / "static"))
    return app


async def serve(config: BridgeConfig, port: int, bind: str, name: str | None = None, key_id: str | None = None,
                trace_url: str | None = None, out: TextIO = sys.stdout) -> None:
    admin = ConsoleAdmin(config, issuer(name), key_id)
    gate = Gate()
    site = Site(config, admin, Jobs(admin, config), gate, trace_url)
    runner = web.AppRunner(build(site), access_log=None)
    await runner.setup()
    tcp = web.TCPSite(runner, bind, port)
    await tcp.start()
    bound = runner.addresses[0][1] if port == 0 else port
    host = f"[{bind}]" if ":" in bind else bind
    print(f"console: http://{host}:{bound}/?token={gate.token}", file=out, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(admin.close)
