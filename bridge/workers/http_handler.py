"""The HTTP handler (SPEC §8.2): a task is POSTed to the app next to the sidecar.

Request: the payload as the body; headers `content-type`, `traceparent`, `rdq.task_id`, `rdq.attempt`,
`rdq.redrive_count`, `rdq.source`, plus the queue's configured headers. Response:
- 2xx: success;
- `rdq-outcome: permanent` or `rdq-outcome: retryable` on any other response: the app decides;
- 408, 429, 5xx, a timeout, a refused or broken connection: retryable, honouring `Retry-After`;
- any other 4xx: permanent.
The response body (truncated) goes into the attempt's error message. Connections are pooled per queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import re
import time
from typing import Any

import aiohttp
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from bridge.config import HttpHandlerConfig
from bridge.handler_api import HandlerContext, Permanent, Retry

OUTCOME_HEADER = "rdq-outcome"
_BODY_KEEP = 2000
BODY_READ_MAX = 64 * 1024  # of a response body, at most this much is read (it only goes into an error message)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PROPAGATOR = TraceContextTextMapPropagator()


class HttpRetryableError(Retry):
    """The app (or the network) failed in a way worth retrying."""

    stable_name = "bridge.http_handler.HttpRetryableError"  # as stored and configured before the module moved


class HttpPermanentError(Permanent):
    """The app refused the task for good."""

    stable_name = "bridge.http_handler.HttpPermanentError"


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` as delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - (now if now is not None else time.time()))
    return None


def classify_response(status: int, headers: Any, body: str, what: str) -> None:
    """Raise the outcome of a response; return on success."""
    explicit = (headers.get(OUTCOME_HEADER) or "").strip().lower()
    message = f"HTTP {status} from {what}: {body[:_BODY_KEEP]}"
    if 200 <= status < 300 and explicit not in ("permanent", "retryable"):
        return
    if explicit == "permanent":
        raise HttpPermanentError(message)
    if explicit == "retryable" or status in (408, 429) or status >= 500:
        raise HttpRetryableError(after=retry_after_seconds(headers.get("Retry-After")), message=message)
    raise HttpPermanentError(message)


async def read_body(response: aiohttp.ClientResponse, limit: int = BODY_READ_MAX) -> str:
    """At most `limit` bytes of the body, as text: an app answering with gigabytes cannot fill our memory."""
    data = await response.content.read(limit)
    return data.decode(response.get_encoding() if response.charset else "utf-8", errors="replace")


class HttpHandler:
    """An async handler for one queue, with its own pooled client session."""

    def __init__(self, config: HttpHandlerConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.timeout),
                connector=aiohttp.TCPConnector(limit=self.config.max_connections))
        return self._session

    def _headers(self, ctx: HandlerContext) -> dict[str, str]:
        # A record's content type and tracestate are anyone's bytes: a CR/LF in them made the request raise and
        # the task retry until DEAD. Control characters are removed (content type) or the header dropped.
        content_type = _CONTROL.sub("", ctx.content_type).strip() or "application/octet-stream"
        headers = {
            "content-type": content_type,
            "rdq.task_id": ctx.task_id,
            "rdq.attempt": str(ctx.attempt),
            "rdq.redrive_count": str(ctx.redrive_count),
            "rdq.source": ctx.source,
            **{name: value.get_secret_value() for name, value in self.config.headers.items()},
        }
        carrier: dict[str, str] = {}
        span = trace.get_current_span()
        if span.get_span_context().is_valid:  # traced: the attempt's span is the app's parent
            _PROPAGATOR.inject(carrier)
        headers["traceparent"] = carrier.get("traceparent") or ctx.headers.get("traceparent", "")
        tracestate = ctx.headers.get("tracestate")
        if tracestate and not _CONTROL.search(tracestate):
            headers["tracestate"] = tracestate
        return headers

    async def __call__(self, ctx: HandlerContext) -> None:
        what = f"{self.config.method} {self.config.url}"
        beating = asyncio.ensure_future(self._beat(ctx))  # the app is working as long as the request is open
        try:
            async with self._client().request(self.config.method, self.config.url, data=ctx.payload,
                                              headers=self._headers(ctx)) as response:
                body = await read_body(response)
                classify_response(response.status, response.headers, body, what)
        except (TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise HttpRetryableError(message=f"no answer from {what} within {self.config.timeout:g}s") from e
        except aiohttp.ClientError as e:  # refused, reset, DNS: the app is not there (yet)
            raise HttpRetryableError(message=f"{what}: {type(e).__name__}: {e}") from e
        finally:
            beating.cancel()

    @staticmethod
    async def _beat(ctx: HandlerContext) -> None:
        while True:
            await asyncio.sleep(1.0)
            ctx.heartbeat()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
