"""The fleet's shared-token check, an ASGI middleware loaded into each vLLM server with ``--middleware``.

What protects what:
  * bind address: servers listen on 127.0.0.1 unless ``--host`` says otherwise; the launcher refuses a
    non-loopback host without a token.
  * this middleware: when ``OFFGRPO_FLEET_TOKEN`` is set in the server's environment, every path except the
    read-only ``/health``, ``/ping``, ``/version`` and ``/is_paused`` needs ``Authorization: Bearer <token>``
    (compared as SHA-256 digests in constant time). That covers generation (``/inference``, ``/v1``) and every
    control endpoint vLLM's dev mode adds: ``/collective_rpc`` (refresh, join), ``/pause``, ``/resume``,
    ``/reset_prefix_cache``, ``/update_weight_version``, ``/sleep``, ``/weight_checker``. vLLM's own ``--api-key``
    guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, not the dev-mode control endpoints. The token
    comes from ``OFFGRPO_FLEET_TOKEN`` in the server's environment (readable by its owner only); a server started
    without one refuses those paths to everyone (closed, not open, by default).
  * the token never appears on a command line: the launcher passes it through the environment and stores it in
    a 0600 file next to the fleet's state.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

TOKEN_ENV = "OFFGRPO_FLEET_TOKEN"
OPEN_PATHS = ("/health", "/ping", "/version", "/is_paused")


class ControlTokenMiddleware:
    """Pure ASGI middleware: reject requests without the fleet token (all of them when no token is configured)."""

    def __init__(self, app, token: str | None = None) -> None:
        """Args: app: the ASGI app. token: the shared token (default: ``$OFFGRPO_FLEET_TOKEN``; unset or empty: every
        guarded path is refused)."""
        self.app = app
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        self._digest = hashlib.sha256(token.encode()).digest() if token else None

    def _authorized(self, scope) -> bool:
        for key, value in scope.get("headers") or ():
            if key.lower() == b"authorization":
                scheme, _, param = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and self._digest is not None:
                    return secrets.compare_digest(hashlib.sha256(param.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        why = (f"{path} needs 'Authorization: Bearer <fleet token>' (set {TOKEN_ENV} on the client)"
               if self._digest is not None else f"this server was started without {TOKEN_ENV}: {path} is closed")
        body = json.dumps({"error": f"unauthorized: {why}"}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
