"""Per-episode MCP servers: each play of an episode starts its own, stopped however it ends.

The server is the real one of tests/scripts/mcp_server.py over stdio; its `pid` tool says which
process answered, so a test can tell the servers apart and check that each is gone.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import anyio
import pytest

from rollout import EpisodeConfig, Finish, RolloutEngine, ScriptedBackend
from tests.support.episodes import tool_call
from tests.tools.test_mcp import SERVER, is_gone, servers_running
from tools import InfrastructureError
from tools.mcp import McpServer, McpServerError, McpTools

pytestmark = pytest.mark.process  # every test starts MCP servers

ROW = {"prompt": "Which process answers?"}
PER_EPISODE = McpServer(command=(sys.executable, SERVER), per_episode=True)


class PidScript:
    """Scripted turns: ask for the server's pid, then the turns of `then` (tool calls, answers).

    Every pid a tool message showed is kept in `pids`. `fail_once` is raised (once) from the
    generator when the second turn is asked for, as a backend whose machinery broke would.
    """

    def __init__(self, tokenizer, then=("Done.",), fail_once: Exception | None = None):
        self.tokenizer, self.then, self.fail_once = tokenizer, then, fail_once
        self.pids: set[int] = set()
        self.answered = threading.Event()  # set once a pid came back

    def respond(self, context: list[int]) -> list[int]:
        text = self.tokenizer.decode(context)
        seen = [int(pid) for pid in re.findall(r"<tool_response>(\d+)</tool_response>", text)]
        self.pids.update(seen)
        if seen:
            self.answered.set()
        if seen and self.fail_once is not None:
            failure, self.fail_once = self.fail_once, None
            raise failure
        done = text.count("<tool_response>")  # tool results so far: the turn to play
        turn = self.then[min(done - 1, len(self.then) - 1)] if done else tool_call("pid")
        return self.tokenizer.encode(turn, add_special_tokens=False) + [self.tokenizer.eos_token_id]

    def engine(self, timeout_s: float = 120.0, **kwargs) -> RolloutEngine:
        eos = self.tokenizer.eos_token_id
        return RolloutEngine(
            ScriptedBackend(self.respond, [eos]),
            self.tokenizer,
            chat_template="chatml_tools",
            config=EpisodeConfig(max_completion_length=512, max_turns=5, tool_timeout_s=timeout_s),
            mcp_servers=[PER_EPISODE],
            **kwargs,
        )


def pids_of(episodes) -> list[int]:
    tool_messages = [m["content"] for e in episodes for m in e.messages if m["role"] == "tool"]
    return [int(content) for content in tool_messages if content.isdigit()]


def test_a_spec_declares_a_server_per_episode():
    spec = {"command": sys.executable, "args": [SERVER], "per_episode": True}
    assert McpServer.parse(spec) == PER_EPISODE
    assert McpServer.parse({"url": "http://127.0.0.1:8/mcp", "per_episode": True}).per_episode
    assert not McpServer.parse(f"{sys.executable} {SERVER}").per_episode


def test_two_concurrent_episodes_get_two_servers_and_both_are_gone_after(tokenizer):
    before = servers_running()
    script = PidScript(tokenizer)
    engine = script.engine()
    try:
        assert servers_running() == before  # the listing server is stopped at once
        episodes = anyio.run(engine.run, [ROW], 2)
        assert [e.finish for e in episodes] == [Finish.STOP, Finish.STOP]
        pids = pids_of(episodes)
        assert len(set(pids)) == 2  # one server each
        assert all(is_gone(pid) for pid in pids)  # stopped as each episode ended
    finally:
        engine.close()
    assert servers_running() == before


def test_an_episode_past_a_tool_error_and_a_tool_timeout_stops_its_server(tokenizer):
    then = [tool_call("fail", reason="on purpose"), tool_call("wait", seconds=600), "Done."]
    engine = PidScript(tokenizer, then=then).engine(timeout_s=1.0)
    try:
        [episode] = anyio.run(engine.run, [ROW], 1)
        assert (episode.finish, episode.stats.tool_failures) == (Finish.STOP, 2)
        [pid] = pids_of([episode])
        assert is_gone(pid)
    finally:
        engine.close()


def test_a_cancelled_episode_stops_its_server(tokenizer):
    script = PidScript(tokenizer, then=[tool_call("wait", seconds=600)])
    engine = script.engine()

    async def cancel_once_it_waits() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(engine.run, [ROW], 1)
            # the server answered; the episode now calls wait(600)
            assert await anyio.to_thread.run_sync(script.answered.wait, 60.0)
            tasks.cancel_scope.cancel()

    try:
        anyio.run(cancel_once_it_waits)
        [pid] = script.pids
        assert is_gone(pid)
    finally:
        engine.close()


def test_an_episode_that_raises_stops_its_server(tokenizer):
    script = PidScript(tokenizer, fail_once=RuntimeError("the generator broke"))
    engine = script.engine()
    try:
        with pytest.raises(RuntimeError, match="the generator broke"):
            anyio.run(engine.run, [ROW], 1)
        [pid] = script.pids
        assert is_gone(pid)
    finally:
        engine.close()


def test_a_replayed_episode_gets_a_fresh_server_and_each_is_stopped(tokenizer):
    script = PidScript(tokenizer, fail_once=InfrastructureError("the generator's node died"))
    engine = script.engine(infra_retries=1)
    try:
        [episode] = anyio.run(engine.run, [ROW], 1)
        assert (episode.finish, episode.stats.infra_retries) == (Finish.STOP, 1)
        [replayed_pid] = pids_of([episode])
        assert len(script.pids) == 2 and replayed_pid in script.pids  # the failed play's, too
        assert all(is_gone(pid) for pid in script.pids)
    finally:
        engine.close()


def test_a_per_episode_tool_is_called_only_in_an_episode_and_a_clash_is_refused():
    before = servers_running()
    shared = McpServer(command=(sys.executable, SERVER))
    with pytest.raises(ValueError, match=r"two MCP servers .* offer a tool named 'add'"):
        McpTools([shared, PER_EPISODE])  # the same tools twice: refused
    assert servers_running() == before  # the shared server is stopped too
    with McpTools([PER_EPISODE]) as mcp:
        assert list(mcp.tools) == ["add", "fail", "pid", "remember", "wait"]
        with pytest.raises(McpServerError, match=r"called only inside McpTools\.episode\(\)"):
            anyio.run(mcp.tools["pid"].fn)


def test_close_stops_the_servers_of_episodes_still_playing():
    before = servers_running()
    mcp = McpTools([PER_EPISODE])

    async def inside_an_episode() -> int:
        async with mcp.episode():
            pid = int(await mcp.tools["pid"].fn())
            mcp.close()  # the run ends while the episode holds its server
            return pid

    pid = anyio.run(inside_an_episode)
    assert is_gone(pid)
    assert servers_running() == before


def test_a_per_episode_http_server_gets_a_session_per_episode_and_is_never_stopped():
    process = subprocess.Popen(
        [sys.executable, SERVER, "--http"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline().split()[1])
        spec = {"url": f"http://127.0.0.1:{port}/mcp", "per_episode": True}

        async def episodes(mcp: McpTools) -> list[str]:
            answers = []
            for a in (1, 2):
                async with mcp.episode():
                    answers.append(await mcp.tools["add"].fn(a=a, b=40))
            return answers

        with McpTools([McpServer.parse(spec)]) as mcp:
            assert anyio.run(episodes, mcp) == ["41", "42"]
        assert process.poll() is None  # reached, never started nor stopped
    finally:
        process.terminate()
        process.wait(timeout=30)
