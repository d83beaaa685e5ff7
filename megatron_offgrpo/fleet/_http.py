"""JSON over HTTP with a timeout on every call (standard library only: the client needs no vLLM install).

Failures are split in two: ``ServerDown`` (connection refused/reset, timeout, 5xx: retry elsewhere, count
towards marking the server dead) and ``RequestRejected`` (4xx: the request itself is wrong or unauthorized,
retrying elsewhere would not help).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any


class ServerDown(ConnectionError):
    """The server did not answer in time, refused or dropped the connection, or failed internally (5xx)."""


class RequestRejected(ValueError):
    """The server answered 4xx: bad request or missing/wrong token. ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def call_json(
    method: str, url: str, body: Any = None, token: str | None = None, timeout: float = 30.0, query: str = ""
) -> Any:
    """One HTTP request; returns the decoded JSON body (None for an empty body).

    Raises:
        ServerDown: connection errors, timeouts and 5xx answers. RequestRejected: 4xx answers.
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + (f"?{query}" if query else ""), data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        if 400 <= exc.code < 500:
            raise RequestRejected(f"{method} {url}: HTTP {exc.code}: {detail}", exc.code) from None
        raise ServerDown(f"{method} {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerDown(f"{method} {url}: {type(reason).__name__}: {reason}") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise ServerDown(f"{method} {url}: answer is not JSON: {raw[:200]!r}") from None
