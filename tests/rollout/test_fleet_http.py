"""The fleet's HTTP calls against real local sockets: answers, the two failure kinds, kept-alive connections and
both timeouts (a server that never accepts the connection, one that never answers)."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from megatron_offgrpo.fleet import json_http
from megatron_offgrpo.fleet import _http


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server
    peers: set[int] = set()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).peers.add(self.client_address[1])
        status, body = {"/ok": (200, b'{"answer": 42}'), "/empty": (200, b""), "/auth": (401, b"no token"),
                        "/crash": (500, b"engine died")}[self.path]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def server():
    _Handler.peers = set()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_answers_failures_and_one_kept_alive_connection(server):
    assert [json_http.call_json("GET", server + "/ok") for _ in range(5)] == [{"answer": 42}] * 5
    assert json_http.call_json("GET", server + "/empty") is None
    assert len(_Handler.peers) == 1  # five calls, one connection: the pool kept it alive
    with pytest.raises(json_http.RequestRejected, match="HTTP 401: no token") as rejected:
        json_http.call_json("GET", server + "/auth")
    assert rejected.value.status == 401
    with pytest.raises(json_http.ServerDown, match="HTTP 500: engine died"):
        json_http.call_json("GET", server + "/crash")


def test_a_refused_connection_is_a_server_down():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(json_http.ServerDown, match="ConnectError"):
        json_http.call_json("GET", f"http://127.0.0.1:{port}/health", timeout=5)


def test_a_server_that_accepts_and_never_answers_times_out_at_the_read_timeout():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the connection; nobody ever reads it (a frozen process)
        start = time.monotonic()
        with pytest.raises(json_http.ServerDown, match="ReadTimeout"):
            json_http.call_json("GET", f"http://127.0.0.1:{silent.getsockname()[1]}/health", timeout=0.5)
        assert time.monotonic() - start < 3


def test_a_connection_nobody_accepts_times_out_at_the_connect_timeout(monkeypatch):
    """A full accept queue drops the SYN, as a vanished node does: the connect gives up after CONNECT_TIMEOUT_S,
    not after the call's (generation-sized) timeout."""
    monkeypatch.setattr(_http, "CONNECT_TIMEOUT_S", 0.5)
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = full.getsockname()
        fillers = []
        for _ in range(4):  # fill the accept queue (backlog 0 holds one)
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(address)
            fillers.append(filler)
        time.sleep(0.2)
        start = time.monotonic()
        try:
            with pytest.raises(json_http.ServerDown, match="ConnectTimeout"):
                json_http.call_json("GET", f"http://127.0.0.1:{address[1]}/health", timeout=60)
        finally:
            for filler in fillers:
                filler.close()
        assert time.monotonic() - start < 5


def test_a_body_goes_as_json_with_the_token():
    seen = {}

    class Echo(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            seen["auth"] = self.headers["Authorization"]
            seen["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["query"] = self.path
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert json_http.call_json("POST", f"http://127.0.0.1:{httpd.server_address[1]}/pause", {"a": [1, 2]}, "secret",
                         query="mode=keep") == {}
    finally:
        httpd.shutdown()
    assert seen == {"auth": "Bearer secret", "body": {"a": [1, 2]}, "query": "/pause?mode=keep"}
