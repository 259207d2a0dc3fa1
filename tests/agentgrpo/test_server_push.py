"""A weight push's two sides, against a real HTTP server whose workers' call waits for the test.

The trainer's side (gathering and broadcasting tensors) runs while the workers' call
(`POST /collective_rpc`) waits for them; an error on either side must reach the trainer, and the
trainer's own at once, not after the server's timeout.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from agentgrpo.generation.weight_sync import ServerPush
from rollout.backends.vllm_server import ServerConnection

WAIT_S = 30.0  # far above what any step here takes; only a bug reaches it


class RPCServer(http.server.ThreadingHTTPServer):
    """Answers `/collective_rpc` with `status` once `release` is set (`answered` then)."""

    def __init__(self, status: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status = status
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.answered = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: RPCServer

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.arrived.set()
        self.server.release.wait(WAIT_S)
        self.server.answered.set()  # before the reply: the client cannot see one before this
        payload = json.dumps({"results": [None]} if self.server.status == 200 else {}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


def serving(status: int) -> Iterator[RPCServer]:
    server = RPCServer(status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    thread.join(WAIT_S)


@pytest.fixture
def waiting_workers() -> Iterator[RPCServer]:
    yield from serving(200)


@pytest.fixture
def failing_workers() -> Iterator[RPCServer]:
    yield from serving(500)


def push_to(server: RPCServer) -> ServerPush:
    return ServerPush(ServerConnection(server.url, timeout_s=WAIT_S), 0)


def test_the_trainers_error_is_raised_while_the_workers_still_wait(waiting_workers):
    def trainer_side() -> None:
        assert waiting_workers.arrived.wait(WAIT_S)  # the workers' call is in flight
        raise RuntimeError("the first gather failed")

    with pytest.raises(RuntimeError, match="the first gather failed"):
        push_to(waiting_workers)._while_server_runs("agentgrpo_receive", "[]", trainer_side)
    assert not waiting_workers.answered.is_set()  # raised before the server's answer


def test_the_workers_error_is_raised_after_the_trainers_side(failing_workers):
    def trainer_side() -> str:
        assert failing_workers.arrived.wait(WAIT_S)
        failing_workers.release.set()
        return "sent"

    with pytest.raises(RuntimeError, match="cannot take agentgrpo's weight pushes"):
        push_to(failing_workers)._while_server_runs("agentgrpo_receive", "[]", trainer_side)


def test_both_sides_done_give_the_trainers_result(waiting_workers):
    def trainer_side() -> str:
        waiting_workers.release.set()
        return "sent"

    push = push_to(waiting_workers)
    assert push._while_server_runs("agentgrpo_receive", "[]", trainer_side) == "sent"
    assert waiting_workers.answered.is_set()
