"""Who may use the console: the login token printed at start (as Jupyter does) becomes an HttpOnly session cookie;
every state-changing request carries the session's CSRF token."""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

COOKIE = "rdq_console"
CSRF_FIELD = "csrf"
CSRF_HEADER = "X-CSRF-Token"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PUBLIC = ("/static/",)  # the stylesheet and script: nothing in them is secret

# Nothing loaded from elsewhere, nothing inline that an escaped payload could smuggle in, never framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",  # the login URL's token never leaves in a Referer
    "Cache-Control": "no-store",
}


@dataclass
class Gate:
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    sessions: dict[str, str] = field(default_factory=dict)  # session id → its CSRF token

    def csrf_of(self, request: web.Request) -> str:
        return self.sessions.get(request.cookies.get(COOKIE, ""), "")

    def _session_of(self, request: web.Request) -> str | None:
        sid = request.cookies.get(COOKIE)
        return sid if sid is not None and sid in self.sessions else None

    def _login(self, request: web.Request) -> web.StreamResponse:
        """The printed URL: a fresh session, then the same page without the token in the address bar."""
        sid = secrets.token_urlsafe(32)
        self.sessions[sid] = secrets.token_urlsafe(32)
        query = {k: v for k, v in request.query.items() if k != "token"}
        response = web.Response(status=303, headers={"Location": request.rel_url.with_query(query).path_qs})
        response.set_cookie(COOKIE, sid, httponly=True, samesite="Strict", path="/")
        return response

    async def _csrf_ok(self, request: web.Request, sid: str) -> bool:
        sent = request.headers.get(CSRF_HEADER)
        if sent is None and request.content_type in ("application/x-www-form-urlencoded", "multipart/form-data"):
            sent = str((await request.post()).get(CSRF_FIELD, ""))
        return bool(sent) and hmac.compare_digest(str(sent), self.sessions[sid])

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await self._checked(request, handler)
        response.headers.update(SECURITY_HEADERS)
        return response

    async def _checked(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(PUBLIC):
            return await handler(request)
        token = request.query.get("token")
        if token is not None and hmac.compare_digest(token.encode(), self.token.encode()):
            return self._login(request)
        sid = self._session_of(request)
        if sid is None:
            return web.Response(status=401, content_type="text/html", text=UNAUTHORIZED)
        if request.method not in ("GET", "HEAD") and not await self._csrf_ok(request, sid):
            return web.Response(status=403, content_type="text/html", text=FORBIDDEN)
        return await handler(request)


UNAUTHORIZED = ("<!doctype html><title>rdq console: log in</title><h1>401: not logged in</h1>"
                "<p>Open the URL <code>rdq console</code> printed when it started (it carries the login token).</p>")
FORBIDDEN = ("<!doctype html><title>rdq console: refused</title><h1>403: no CSRF token</h1>"
             "<p>A request that changes something must come from a console page. Reload the page and try again.</p>")
