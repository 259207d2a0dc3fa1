"""`--mcp-server` of `agentgrpo run`: repeatable, into `mcp_servers`, checked before loading."""

from __future__ import annotations

import argparse
import shlex
import sys

import anyio
import pytest

from agentgrpo.cli.options import UsageError, add_config_options, config_overrides, grpo_config
from agentgrpo.config import GRPOConfig
from agentgrpo.rounds.wiring import build_engine
from tests.support.episodes import scripted_backend
from tests.tools.test_mcp import SERVER, is_gone
from tools import call_tool


def overrides(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_config_options(parser)
    return config_overrides(parser.parse_args(argv))


def test_each_mcp_server_option_adds_one_server():
    argv = ["--mcp-server", "python server.py --flag", "--mcp-server", "http://127.0.0.1:8/mcp"]
    assert overrides(argv) == {"mcp_servers": ["python server.py --flag", "http://127.0.0.1:8/mcp"]}


def test_a_server_whose_command_is_not_here_is_a_usage_error_naming_the_option(tmp_path):
    fields = overrides(["--mcp-server", "no-such-mcp-server-command"])
    with pytest.raises(UsageError, match=r"mcp_servers\[0\]: cannot start MCP server"):
        grpo_config({"output_dir": str(tmp_path), "report_to": "none", **fields})


@pytest.mark.process
def test_a_runs_engine_offers_its_configured_servers_tools_and_stops_them_on_close(
    tokenizer, tmp_path
):
    command = shlex.join([sys.executable, SERVER])
    config = GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        chat_template="chatml_tools",
        mcp_servers=[command],
    )
    engine = build_engine(config, scripted_backend(tokenizer, ["Done."]), tokenizer, None)
    try:
        assert {"add", "pid"} <= set(engine.context.tools)
        pid = anyio.run(call_tool, engine.context.tools, "pid", {}, 30.0).content
    finally:
        engine.close()
    assert is_gone(int(pid))
