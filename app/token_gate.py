"""The UI's login on loopback: a per-start token, as Jupyter does (an ASGI middleware).

Loopback is not a trust boundary: every local user reaches 127.0.0.1. So ``asyncrl ui`` without
``--auth`` makes a random token when it starts and serves only requests that carry it: the URL it
prints ends in ``?token=...``; a request with the right token (on any path) is served and its answer
sets a cookie holding the token (``HttpOnly``, ``SameSite=Strict``, named after the port: two UIs on
one host do not overwrite each other's), so the page's own requests (assets, the event stream, the
API) carry it from then on. Anything else is answered ``401`` with a line saying where the token
is; a websocket without it is closed (policy violation). Tokens are compared in constant time.

One route stays open: Gradio's ``startup-events``, which ``launch`` itself requests (without the
token) to start the app, and which only runs the app's start-up handlers once.
"""

from __future__ import annotations

import hmac
import secrets
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

COOKIE_MAX_AGE_S = 30 * 24 * 3600


def new_token() -> str:
    return secrets.token_urlsafe(24)


def cookie_name(port: int) -> str:
    return f"asyncrl_ui_{port}"


class TokenGate:
    def __init__(self, app, token: str):
        self.app, self.token = app, token
        self.refused = 0

    def _matches(self, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), self.token.encode())

    @staticmethod
    def _cookie(scope, name: str) -> str | None:
        for key, value in scope.get("headers") or ():
            if key == b"cookie":
                try:
                    jar = SimpleCookie(value.decode("latin-1"))
                except CookieError:
                    continue
                if name in jar:
                    return jar[name].value
        return None

    async def __call__(self, scope, receive, send):
        if scope.get("type") not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        port = (scope.get("server") or ("", 0))[1]
        name = cookie_name(port)
        if self._matches(self._cookie(scope, name)) or scope.get("path", "").rstrip("/").endswith("/startup-events"):
            return await self.app(scope, receive, send)
        given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [None])[0]
        if self._matches(given):
            cookie = (f"{name}={self.token}; Path=/; Max-Age={COOKIE_MAX_AGE_S}; HttpOnly; SameSite=Strict").encode()

            async def with_cookie(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
                await send(message)

            return await self.app(scope, receive, with_cookie)
        self.refused += 1
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = (
            b"this dashboard is served only with its token: open the URL that `asyncrl ui` printed "
            b"(it ends in ?token=...)\n"
        )
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
