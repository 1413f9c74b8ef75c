"""A limit on failed logins per client, in front of Gradio's ``/login`` (an ASGI middleware).

Gradio answers every login attempt at once (50 wrong passwords in 1.17 s were all answered), so a
password can be guessed at the speed of the network. :class:`LoginLimiter` counts the failed logins
(answered 400) of each client address: after ``max_failures`` within ``window_s`` seconds, that
client's further logins are answered ``429 Too Many Requests`` (with ``Retry-After``) without being
checked, the right password included, until the oldest failure leaves the window. Other clients and
other routes are untouched; a successful login clears the client's count. Memory is bounded
(``max_clients`` addresses, the least recently seen forgotten first).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque


class LoginLimiter:
    def __init__(self, app, max_failures: int = 5, window_s: float = 60.0, max_clients: int = 10_000):
        self.app = app
        self.max_failures, self.window_s, self.max_clients = max_failures, window_s, max_clients
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()
        self.refused = 0

    def _recent(self, client: str, now: float) -> deque[float]:
        q = self._failures.get(client)
        if q is None:
            q = self._failures[client] = deque()
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)
        self._failures.move_to_end(client)
        while q and now - q[0] > self.window_s:
            q.popleft()
        return q

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if scope.get("method") != "POST" or path.rstrip("/").rsplit("/", 1)[-1] != "login":
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("?", 0))[0]
        now = time.monotonic()
        with self._lock:
            q = self._recent(client, now)
            wait = self.window_s - (now - q[0]) if len(q) >= self.max_failures else 0.0
        if wait > 0:
            self.refused += 1
            body = json.dumps(
                {
                    "detail": f"too many failed logins from {client}: {len(q)} in the last "
                    f"{self.window_s:g} s; try again in {wait:.0f} s"
                }
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 429,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", str(int(wait) + 1).encode()),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        status = {}

        async def watch(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, receive, watch)
        with self._lock:
            q = self._recent(client, time.monotonic())
            if status.get("code") == 200:
                q.clear()
            elif status.get("code") in (400, 401, 403):
                q.append(time.monotonic())
