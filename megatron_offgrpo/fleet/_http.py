"""JSON over HTTP: pooled keep-alive connections, a connect timeout of seconds, a read timeout per call.

One ``httpx.Client`` per process carries every call: a group request reuses a connection to its server instead of
opening one per request, and a server whose node died without a reset (no RST: the kernel retries the SYN for about
two minutes) fails the connect in ``CONNECT_TIMEOUT_S``. The read timeout is the caller's, sized to what it waits for
(a generation: minutes; a health check: seconds): a frozen server that accepted a request is found by the fleet's
health checks, not by this timeout (``rollout._dispatch``).

Failures are split in two: ``ServerDown`` (connection refused/reset, timeout, 5xx: retry elsewhere, count
towards marking the server dead) and ``RequestRejected`` (4xx: the request itself is wrong or unauthorized,
retrying elsewhere would not help).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import httpx

CONNECT_TIMEOUT_S = 5.0
"""A live server on a reachable node accepts a connection in milliseconds, even while it decodes."""

_lock = threading.Lock()
_client: tuple[int, httpx.Client] | None = None  # (pid that made it, client): a forked child makes its own


class ServerDown(ConnectionError):
    """The server did not answer in time, refused or dropped the connection, or failed internally (5xx)."""


class RequestRejected(ValueError):
    """The server answered 4xx: bad request or missing/wrong token. ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _shared_client() -> httpx.Client:
    global _client
    with _lock:
        if _client is None or _client[0] != os.getpid():
            # no cap on connections: the dispatcher bounds the requests per server (RetryPolicy)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            _client = (os.getpid(), httpx.Client(limits=limits, trust_env=False))
        return _client[1]


def call_json(
    method: str, url: str, body: Any = None, token: str | None = None, timeout: float = 30.0, query: str = ""
) -> Any:
    """One HTTP request; returns the decoded JSON body (None for an empty body). ``timeout`` bounds each read (and
    the connect, at most ``CONNECT_TIMEOUT_S``).

    Raises:
        ServerDown: connection errors, timeouts and 5xx answers. RequestRejected: 4xx answers.
    """
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    limits = httpx.Timeout(timeout, connect=min(CONNECT_TIMEOUT_S, timeout))
    try:
        response = _shared_client().request(method, url + (f"?{query}" if query else ""), headers=headers,
                                            content=None if body is None else json.dumps(body).encode(),
                                            timeout=limits)
    except httpx.HTTPError as exc:  # connect/read/write timeouts, refused or reset connections, protocol errors
        raise ServerDown(f"{method} {url}: {type(exc).__name__}: {exc or 'no detail'}") from None
    if response.status_code >= 400:
        detail = response.text[:2000]
        if response.status_code < 500:
            raise RequestRejected(f"{method} {url}: HTTP {response.status_code}: {detail}", response.status_code)
        raise ServerDown(f"{method} {url}: HTTP {response.status_code}: {detail}")
    if not response.content:
        return None
    try:
        return response.json()
    except json.JSONDecodeError:
        raise ServerDown(f"{method} {url}: answer is not JSON: {response.content[:200]!r}") from None
