"""OpenEnv environments a server serves (`openenv:http://host:port`), against OpenEnv's own server.

Each server is OpenEnv's FastAPI app (``create_app``) run by uvicorn in a thread of this process,
on a free loopback port, and shut down however its tests end.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest

pytest.importorskip("openenv.core")

import uvicorn
from openenv.core import create_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

from environments import EnvironmentSpecError, class_tools, resolve_environment
from environments.contract import episode_limits
from rollout import Finish
from tests.support.episodes import chatml_engine, scripted_backend, tool_call
from tests.support.openenv_envs import Notes, Walk, WalkAction, WalkObservation
from tools import InfrastructureError

pytestmark = pytest.mark.process  # each module-scoped server is a server the tests start
SESSIONS = 4


@contextmanager
def serving(app) -> Iterator[str]:
    """Serve `app` on a free loopback port; yield its address; stop it on every path."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def walk_url() -> Iterator[str]:
    with serving(
        create_app(Walk, WalkAction, WalkObservation, max_concurrent_envs=SESSIONS)
    ) as url:
        yield url


def test_a_served_environment_has_the_same_typed_tool_as_in_process(walk_url):
    served = resolve_environment(f"openenv:{walk_url}")
    local = resolve_environment("openenv:tests.support.openenv_envs:Walk")
    schema = class_tools(served)["act"].schema["function"]["parameters"]
    assert schema == class_tools(local)["act"].schema["function"]["parameters"]
    assert resolve_environment(f"openenv:{walk_url}") is served


def test_a_served_episode_keeps_step_rewards_done_and_refuses_bad_actions(walk_url):
    env = resolve_environment(f"openenv:{walk_url}")()
    assert env.reset(seed=0, start=1) == "You are on square 1; walk to square 3."
    with pytest.raises(ValueError, match="the action was refused: squares: 3 is greater than"):
        env.act(direction="right", squares=3)
    assert env.act(direction="left") == "You are on square 0."
    assert env.turn_reward() == -0.25
    assert env.act(direction="right", squares=2) == "You are on square 2."
    assert env.act(direction="right").endswith("You are there! (episode over)")
    assert env.done and env.reward() == 0.5 and env.steps == 3
    env.close()


def test_a_full_server_says_how_to_make_room(walk_url):
    cls = resolve_environment(f"openenv:{walk_url}")
    envs = [cls() for _ in range(SESSIONS + 1)]
    try:
        for env in envs[:SESSIONS]:
            env.reset(seed=0)
        with pytest.raises(
            EnvironmentSpecError,
            match=r"refused the session: Server at capacity.*max_concurrent_envs",
        ):
            envs[SESSIONS].reset(seed=0)
    finally:
        for env in envs:
            env.close()


def test_a_scripted_group_plays_concurrent_sessions_through_the_engine(walk_url, tokenizer):
    cls = resolve_environment(f"openenv:{walk_url}")
    row = cls.dataset("eval")[0]
    turns = [tool_call("act", direction="right", squares=2), tool_call("act", direction="right")]
    engine = chatml_engine(
        scripted_backend(tokenizer, [*turns, "never"]), tokenizer, cls, **episode_limits(cls)
    )
    episodes = anyio.run(engine.run, [row], 2, 10)
    assert [episode.finish for episode in episodes] == [Finish.ENV_DONE] * 2
    assert [episode.env_reward for episode in episodes] == [0.75, 0.75]


@pytest.mark.filterwarnings("ignore:Accessing `Tool.inputSchema`")  # the server's, in a thread
def test_a_served_mcp_environment_lists_its_tools_as_tools():
    app = create_app(Notes, CallToolAction, CallToolObservation, max_concurrent_envs=SESSIONS)
    with serving(app) as url:
        cls = resolve_environment(f"openenv:{url},timeout=10")
        assert list(class_tools(cls)) == ["add_note", "count_notes", "fail"]
        env = cls()
        env.reset(seed=0)
        assert env.add_note(text="milk", priority="right") == "1 notes."
        assert env.count_notes() == "1"
        with pytest.raises(ValueError, match="the page is torn"):
            env.fail()
        env.close()


def test_a_server_gone_mid_episode_is_an_infrastructure_failure():
    with serving(create_app(Walk, WalkAction, WalkObservation, max_concurrent_envs=2)) as url:
        env = resolve_environment(f"openenv:{url},timeout=5")()
        env.reset(seed=0)
    try:
        with pytest.raises(InfrastructureError, match="step got no answer"):
            env.act(direction="right")
    finally:
        env.close()


def test_a_server_that_never_answers_is_a_spec_error_within_the_timeout():
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(EnvironmentSpecError, match=r"no OpenEnv server answered .* within 1 s"):
            resolve_environment(f"openenv:{url},timeout=1")
        assert time.monotonic() - start < 20  # the timeout bounds it, not a hang


@pytest.mark.parametrize(
    ("option", "message"),
    [("timeout=0", "must be a number of seconds > 0"), ("size=3", "unknown option")],
)
def test_bad_server_options_are_spec_errors(option, message):
    with pytest.raises(EnvironmentSpecError, match=message):
        resolve_environment(f"openenv:http://127.0.0.1:9,{option}")
