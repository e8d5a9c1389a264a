"""deploy/nginx/nginx.conf in front of two stub replicas: a POST goes to a second replica
only when the first never started it, so no completion runs twice."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.deploy.procs import free_port


class Stub:
    """An upstream on 127.0.0.1 that answers every POST the same way and counts them:
    "ok" (200), "turn away" (503 before any work, as spyre-serve while draining) or
    "drop" (reads the request, then closes the connection without an answer)."""

    def __init__(self, behaviour: str):
        stub = self
        self.posts = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                stub.posts += 1
                if behaviour == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                code, body = (503, b"draining") if behaviour == "turn away" else (200, b"ok")
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs():
    made: list[Stub] = []

    def make(behaviour: str) -> Stub:
        made.append(Stub(behaviour))
        return made[-1]

    yield make
    for s in made:
        s.close()


def post(front) -> int:
    return httpx.post(front.url + "/v1/completions", json={"prompt": "x"}, timeout=30).status_code


def test_a_post_a_replica_turned_away_with_503_is_served_by_the_other(stubs, nginx):
    first, second = stubs("turn away"), stubs("ok")
    front = nginx([first.address, second.address])
    assert [post(front) for _ in range(4)] == [200] * 4
    assert second.posts == 4


def test_a_post_sent_to_a_replica_that_then_fails_is_not_sent_to_another(stubs, nginx):
    first, second = stubs("drop"), stubs("ok")
    front = nginx([first.address, second.address])
    statuses = [post(front) for _ in range(3)]
    assert first.posts + second.posts == 3       # every POST reached one replica, no more
    # the one the failing replica took is a 502; then it is skipped for fail_timeout
    assert statuses.count(502) == first.posts == 1


def test_a_post_to_a_replica_that_refuses_connections_is_served_by_the_other(stubs, nginx):
    second = stubs("ok")
    front = nginx([f"127.0.0.1:{free_port()}", second.address])    # nothing listens there
    assert [post(front) for _ in range(2)] == [200] * 2
    assert second.posts == 2
