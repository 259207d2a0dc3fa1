"""Episodes whose tools come from a real MCP server (tests/scripts/mcp_server.py) over stdio."""

from __future__ import annotations

import sys

import anyio
import pytest

from rollout import EpisodeConfig, RolloutEngine
from tests.support.episodes import scripted_backend, tool_call
from tests.tools.test_mcp import SERVER, is_gone, servers_running
from tools.mcp import McpServer

pytestmark = pytest.mark.process  # every test starts an MCP server

ROW = {"prompt": "What is 2 + 40?"}


def mcp_engine(tokenizer, turns: list[str], *flags: str, **kwargs) -> RolloutEngine:
    """An engine whose only tools are the test server's (run with `flags`), turns scripted."""
    return RolloutEngine(
        scripted_backend(tokenizer, turns),
        tokenizer,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=256, max_turns=3),
        mcp_servers=[McpServer(command=(sys.executable, SERVER, *flags))],
        **kwargs,
    )


def tool_messages(episode) -> list[str]:
    return [message["content"] for message in episode.messages if message["role"] == "tool"]


def test_the_models_call_reaches_the_server_and_its_answer_is_the_tool_message(tokenizer):
    engine = mcp_engine(tokenizer, [tool_call("add", a=2, b=40), "It is 42."])
    try:
        episodes = anyio.run(engine.run, [ROW], 2)
        assert [tool_messages(e) for e in episodes] == [["42"], ["42"]]
        for episode in episodes:
            (row,) = episode.rows
            pairs = zip(row.completion_ids, row.loss_mask, strict=True)
            masked_out = [token for token, mask in pairs if not mask]
            assert "<tool_response>42</tool_response>" in tokenizer.decode(masked_out)
            assert (episode.stats.tool_calls, episode.stats.tool_failures) == (1, 0)
            assert "Add two integers." in tokenizer.decode(row.prompt_ids)  # the tool is shown
    finally:
        engine.close()


def test_every_episode_and_round_shares_one_server_until_close(tokenizer):
    engine = mcp_engine(tokenizer, [tool_call("remember", note="x"), tool_call("pid"), "Done."])
    try:
        first = anyio.run(engine.run, [ROW], 2)
        second = anyio.run(engine.run, [ROW], 1)  # a new round: a new event loop, same server
        notes = sorted(int(tool_messages(e)[0]) for e in [*first, *second])
        pids = {tool_messages(e)[1] for e in [*first, *second]}
        assert (notes, len(pids)) == ([1, 2, 3], 1)
    finally:
        engine.close()
    assert is_gone(int(pids.pop()))


def test_an_engine_that_fails_after_starting_its_servers_stops_them(tokenizer):
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: One.
            b: The other.
        """
        return a + b

    before = servers_running()
    with pytest.raises(ValueError, match=r"\['add'\] are both plain tools and tools of an MCP"):
        mcp_engine(tokenizer, ["Done."], "--linger", tools=[add])  # ended only by a signal
    assert servers_running() == before
