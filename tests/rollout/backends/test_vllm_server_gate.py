"""Weight pushes between the requests of the vLLM server backend, against a real HTTP server.

The server on localhost answers as `agentgrpo vllm-serve` does (`/v1/completions`, `/pause`,
`/abort_requests`, `/resume`), but a completion runs only when the test lets it, so the order of
requests and pushes is the test's, not the scheduler's. A request cut short by a pause returns
the one token it had sampled; a request that arrives while the server is paused returns none.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import anyio
import pytest

from rollout.backends import request_gate
from rollout.backends.vllm_server import ServerConnection, ServerRequestError, VLLMServerBackend
from rollout.types import SamplingParams

WAIT_S = 30.0  # far above what any step here takes; only a bug reaches it


class HeldServer(http.server.ThreadingHTTPServer):
    """A completions server whose requests wait for `release`, or for a pause to cut them."""

    def __init__(self, pausable: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.pausable = pausable
        self.changed = threading.Condition()
        self.release = False
        self.paused = False
        self.cuts = 0  # pauses and aborts so far
        self.bodies: list[dict] = []  # completion requests, in arrival order
        self.calls: list[str] = []  # pause, abort and resume calls, in order

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def let_go(self) -> None:
        with self.changed:
            self.release = True
            self.changed.notify_all()

    def wait_for_requests(self, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.bodies) >= count, WAIT_S)

    def complete(self, body: dict) -> dict:
        """Two tokens, the second a stop; one (or none, if never run) when a pause cuts it."""
        with self.changed:
            self.bodies.append(body)
            self.changed.notify_all()
            cuts, arrived_paused = self.cuts, self.paused
            self.changed.wait_for(lambda: self.cuts > cuts or self.release, WAIT_S)
            cut = self.cuts > cuts
        tokens = [] if cut and arrived_paused else [5] if cut else [5, 2]
        logprobs = [-0.5, -0.25][: len(tokens)]
        finish = "abort" if cut else "stop"
        return {"choices": [{"token_ids": tokens, "logprobs": {"token_logprobs": logprobs},
                             "finish_reason": finish}]}  # fmt: skip

    def control(self, path: str) -> None:
        with self.changed:
            self.calls.append(path)
            if path.startswith(("/pause", "/abort_requests")):
                self.cuts += 1
            self.paused = path.startswith("/pause") or (self.paused and path != "/resume")
            self.changed.notify_all()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: HeldServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/v1/completions":
            self._reply(200, self.server.complete(body))
        elif self.server.pausable:
            self.server.control(self.path)
            self._reply(200, {})
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_GET(self) -> None:
        self._reply(200, {"data": [{"id": "m", "max_model_len": 64}]})  # /v1/models

    def _reply(self, status: int, reply: dict) -> None:
        payload = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


def serving(held: HeldServer) -> Iterator[HeldServer]:
    thread = threading.Thread(target=held.serve_forever, daemon=True)
    thread.start()
    yield held
    held.let_go()
    held.shutdown()
    thread.join(WAIT_S)


@pytest.fixture
def server() -> Iterator[HeldServer]:
    yield from serving(HeldServer())


def backend_of(server: HeldServer, version: int | None = 0) -> VLLMServerBackend:
    backend = VLLMServerBackend(ServerConnection(server.url, WAIT_S), "m", stop_token_ids={2})
    if version is not None:
        backend.set_weights_version(version)
    return backend


PARAMS = SamplingParams(max_tokens=4, seed=10)


@pytest.mark.anyio
async def test_a_push_cuts_the_request_in_flight_and_continues_it_with_the_new_weights(server):
    backend, completions, order = backend_of(server), [], []

    async def generate() -> None:
        completions.append(await backend.generate([1, 3], PARAMS))

    def push() -> None:
        order.append(f"push after {server.calls}")
        server.let_go()  # the continuation completes

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(generate)
        await anyio.to_thread.run_sync(server.wait_for_requests, 1)
        await backend.between_steps(push, 1)
    [completion] = completions
    assert order == ["push after ['/pause?mode=abort']"]  # pushed once nothing was in flight
    assert server.calls == ["/pause?mode=abort", "/resume"]
    assert completion.token_ids == [5, 5, 2] and completion.stopped
    assert completion.logprobs == [-0.5, -0.5, -0.25]
    assert completion.versions == [0, 1, 1]  # one token before the push, two after
    continued = server.bodies[1]
    assert continued["prompt"] == [1, 3, 5]  # the prompt, then what it had sampled
    assert (continued["max_tokens"], continued["seed"]) == (3, 11)


@pytest.mark.anyio
async def test_a_request_sent_during_a_push_waits_for_it(server):
    backend, pushing, go_on, completions = (
        backend_of(server),
        threading.Event(),
        threading.Event(),
        [],
    )
    server.let_go()

    def push() -> None:
        pushing.set()
        assert go_on.wait(WAIT_S)

    async def generate() -> None:
        completions.append(await backend.generate([1, 3], PARAMS))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(backend.between_steps, push, 7)
        assert await anyio.to_thread.run_sync(pushing.wait, WAIT_S)
        tasks.start_soon(generate)
        await anyio.sleep(0.2)
        assert server.bodies == []  # held back until the push is done
        go_on.set()
    assert completions[0].versions == [7, 7]


def test_a_push_asks_again_until_a_request_that_came_late_is_back(monkeypatch):
    """A request past the gate before the push, that reaches the server after its pause."""
    monkeypatch.setattr(request_gate, "ABORT_EVERY_S", 0.05)
    gate, aborts, entered, second = (
        request_gate.RequestGate(),
        [],
        threading.Event(),
        threading.Event(),
    )

    def late_request() -> None:
        with gate.request():
            entered.set()
            assert second.wait(WAIT_S)  # only an abort after it arrived brings it back

    def abort() -> None:
        aborts.append(1)
        if len(aborts) == 2:
            second.set()

    thread = threading.Thread(target=late_request, daemon=True)
    thread.start()
    assert entered.wait(WAIT_S)
    with gate.holding():
        gate.wait_until_idle(abort, WAIT_S)
    thread.join(WAIT_S)
    assert len(aborts) == 2


def test_requests_that_never_come_back_fail_the_push_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(request_gate, "ABORT_EVERY_S", 0.05)
    gate, done = request_gate.RequestGate(), threading.Event()

    def stuck() -> None:
        with gate.request():
            done.wait(WAIT_S)

    thread = threading.Thread(target=stuck, daemon=True)
    thread.start()
    with gate.holding(), pytest.raises(TimeoutError, match="1 request"):
        gate.wait_until_idle(lambda: None, timeout_s=0.2)
    done.set()
    thread.join(WAIT_S)


@pytest.mark.anyio
async def test_a_failed_push_resumes_the_server_and_lets_requests_through(server):
    backend = backend_of(server)
    server.let_go()

    def fail() -> None:
        raise RuntimeError("broadcast failed")

    with pytest.raises(RuntimeError, match="broadcast failed"):
        await backend.between_steps(fail, 1)
    assert server.calls[-1] == "/resume"
    assert (await backend.generate([1, 3], PARAMS)).versions == [0, 0]  # the version kept


@pytest.mark.anyio
async def test_a_server_that_cannot_pause_is_named_with_the_fix():
    for held in serving(HeldServer(pausable=False)):
        with pytest.raises(ServerRequestError, match="start it with `agentgrpo vllm-serve`"):
            await backend_of(held).between_steps(lambda: None, 1)


@pytest.mark.anyio
async def test_a_backend_without_a_version_tags_nothing(server):
    server.let_go()
    assert (await backend_of(server, version=None).generate([1, 3], PARAMS)).versions is None


def test_connecting_resumes_a_server_that_a_killed_run_left_paused(server):
    server.control("/pause?mode=abort")  # a run killed mid-push left it so
    VLLMServerBackend.connect(ServerConnection(server.url, WAIT_S), stop_token_ids={2})
    assert server.calls == ["/pause?mode=abort", "/resume"] and not server.paused


def test_connecting_to_a_server_without_pauses_is_fine():
    for held in serving(HeldServer(pausable=False)):
        backend = VLLMServerBackend.connect(ServerConnection(held.url, WAIT_S), stop_token_ids={2})
        assert (backend.model, backend.context_limit) == ("m", 64)
