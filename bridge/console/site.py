"""What every page shares: the config, the admin client, the jobs, the templates and how a page is rendered."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

import jinja2
from aiohttp import web

from bridge.clock import rfc3339
from bridge.config import BridgeConfig
from bridge.console.admin import ConsoleAdmin
from bridge.console.gate import CSRF_FIELD, Gate
from bridge.console.jobs import Jobs

ENV = jinja2.Environment(loader=jinja2.PackageLoader("bridge.console", "templates"),
                         autoescape=True,  # every payload, header and error message shown escaped
                         trim_blocks=True, lstrip_blocks=True)
ENV.filters["tojson_pretty"] = lambda value: json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False,
                                                        default=str)
ENV.filters["when"] = lambda value: rfc3339(value) if isinstance(value, int) else (value or "")
ENV.filters["ms"] = lambda value: "" if value is None else f"{value:,} ms"


@dataclass
class Site:
    config: BridgeConfig
    admin: ConsoleAdmin
    jobs: Jobs
    gate: Gate
    trace_url: str | None = None
    name: str = "console"

    def render(self, request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
        page = ENV.get_template(template).render(
            csrf=self.gate.csrf_of(request), csrf_field=CSRF_FIELD, issuer=self.admin.session.issued_by,
            group=self.config.kafka.group_id, now=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            **context)
        return web.Response(text=page, status=status, content_type="text/html")
