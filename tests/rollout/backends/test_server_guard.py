"""`agentgrpo vllm-serve`'s door: the key on every path, loopback only without one.

The guard runs here as the ASGI application it is, in process; the real vLLM server behind it is
tested in `tests/end_to_end/vllm/test_vllm_server.py` (started with a key).
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import ClassVar

import anyio
import pytest

from agentgrpo.generation import vllm_serve
from rollout.backends.server_guard import KEY_VARIABLE, MAX_REQUEST_MB, ServerGuard
from rollout.backends.vllm_server import ServerConnection, ServerRequestError

KEY = "a-key-of-the-test"


def answer(scope_type: str, path: str, headers: dict[str, str]) -> tuple[int | None, list]:
    """Send one request through `ServerGuard`: (the status it answered, or None if it passed it
    on to the application), and the messages it sent."""
    reached: list[str] = []

    async def application(scope, receive, send) -> None:
        reached.append(scope["path"])

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": scope_type,
        "path": path,
        "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()],
    }
    anyio.run(ServerGuard(application), scope, receive, send)
    if reached:
        return None, sent
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    return (start["status"] if start else None), sent


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, KEY)


@pytest.fixture
def keyless(monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)


@pytest.mark.parametrize("path", ["/collective_rpc", "/pause", "/v1/completions", "/metrics"])
def test_with_a_key_every_path_needs_it(keyed, path):
    host = {"Host": "gpu-box:8000"}
    assert answer("http", path, host)[0] == 401
    assert answer("http", path, {**host, "Authorization": "Bearer another-key"})[0] == 401
    assert answer("http", path, {**host, "Authorization": KEY})[0] == 401  # no scheme
    assert answer("http", path, {**host, "Authorization": f"Bearer {KEY}"})[0] is None


def test_a_refusal_says_what_to_send_and_a_websocket_without_the_key_is_closed(keyed):
    status, sent = answer("http", "/collective_rpc", {})
    assert status == 401 and KEY_VARIABLE in json.loads(sent[-1]["body"])["error"]
    assert answer("websocket", "/v1/realtime", {})[1] == [{"type": "websocket.close", "code": 1008}]
    assert answer("lifespan", "", {})[0] is None


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "[::1]:8000", "localhost"])
def test_without_a_key_requests_addressed_to_this_machine_pass(keyless, host):
    assert answer("http", "/collective_rpc", {"Host": host})[0] is None


@pytest.mark.parametrize("host", ["attacker.example:8000", "10.0.0.5:8000", "", "127.0.0.1.ex"])
def test_without_a_key_requests_addressed_to_another_name_are_refused(keyless, host):
    """A page in this machine's browser reaching 127.0.0.1 through its own DNS name sends its
    name as `Host`: refused, as is a request with none."""
    status, sent = answer("http", "/collective_rpc", {"Host": host})
    assert status == 403 and "localhost" in json.loads(sent[-1]["body"])["error"]


def test_a_body_too_large_or_of_no_length_is_refused_unread(keyed):
    """vLLM reads a body whole into memory: 3 GB from a local client held 5.7 GB of the server."""
    allowed = {"Host": "127.0.0.1:8000", "Authorization": f"Bearer {KEY}"}
    over = str((MAX_REQUEST_MB << 20) + 1)
    assert answer("http", "/v1/completions", {**allowed, "Content-Length": over})[0] == 413
    assert answer("http", "/v1/completions", {**allowed, "Content-Length": "-5"})[0] == 413
    chunked = {**allowed, "Transfer-Encoding": "chunked"}
    assert answer("http", "/v1/completions", chunked)[0] == 411
    fits = {**allowed, "Content-Length": str(MAX_REQUEST_MB << 20)}
    assert answer("http", "/v1/completions", fits)[0] is None


def test_vllm_serve_listens_on_loopback_unless_a_key_is_set(keyless, monkeypatch, capsys):
    options, _ = vllm_serve._parser().parse_known_args(["--model", "m"])
    assert options.host == "127.0.0.1"
    assert vllm_serve.exposure_refusal("127.0.0.1", []) is None
    assert vllm_serve.exposure_refusal("::1", []) is None
    for host in ("0.0.0.0", "::", "gpu-box"):
        assert f"--host {host} lets anyone" in vllm_serve.exposure_refusal(host, [])
    monkeypatch.setattr(vllm_serve.importlib.util, "find_spec", lambda name: object())
    assert vllm_serve.main(["--model", "m", "--host", "0.0.0.0"]) == 2  # before any exec
    assert KEY_VARIABLE in capsys.readouterr().err
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    assert vllm_serve.exposure_refusal("0.0.0.0", []) is None


def test_vllm_serve_refuses_vllms_api_key_which_leaves_the_weight_endpoints_open(keyed):
    for passthrough in (["--api-key", "k"], ["--api-key=k"]):
        assert KEY_VARIABLE in vllm_serve.exposure_refusal("127.0.0.1", passthrough)


class _Recording(http.server.BaseHTTPRequestHandler):
    """Answers like `ServerGuard` in front of a server with `KEY`; records what it was sent."""

    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        good = self.headers.get("Authorization") == f"Bearer {KEY}"
        payload = b'{"data": []}' if good else b'{"error": "this server needs its key"}'
        self.send_response(200 if good else 401)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


def test_the_trainers_connection_sends_the_key_of_its_environment(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        monkeypatch.delenv(KEY_VARIABLE, raising=False)
        with pytest.raises(ServerRequestError, match=f"Set {KEY_VARIABLE} here") as refused:
            ServerConnection(url, timeout_s=10).get("/v1/models")
        assert refused.value.status == 401
        monkeypatch.setenv(KEY_VARIABLE, KEY)
        assert ServerConnection(url, timeout_s=10).get("/v1/models") == {"data": []}
        assert _Recording.seen == [None, f"Bearer {KEY}"]
    finally:
        server.shutdown()
