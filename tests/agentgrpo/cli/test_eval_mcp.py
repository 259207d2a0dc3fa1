"""`agentgrpo eval --mcp-server`: eval's episodes offer and call MCP servers' tools, as run's do.

The command runs in-process on the tiny model folder, its generator replaced by a scripted
one that calls the real test server's `pid` tool (tests/scripts/mcp_server.py), so the
episodes file shows which server process answered each episode.
"""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest

from agentgrpo.cli import main
from agentgrpo.generation import evaluation
from tests.support.cli import eval_figures
from tests.support.episodes import scripted_backend, tool_call
from tests.tools.test_mcp import SERVER, is_gone, servers_running

pytestmark = pytest.mark.process  # starts MCP servers

SHARED = shlex.join([sys.executable, SERVER])
PER_EPISODE = json.dumps({"command": sys.executable, "args": [SERVER], "per_episode": True})


@pytest.mark.parametrize(("spec", "servers"), [(SHARED, 1), (PER_EPISODE, 2)])
def test_eval_offers_the_mcp_servers_tools_and_stops_the_servers(
    tokenizer, tiny_model_dir, tmp_path, monkeypatch, capsys, spec, servers
):
    backend = scripted_backend(tokenizer, [tool_call("pid"), "Done."])
    monkeypatch.setattr(evaluation, "evaluation_backend", lambda *a, **k: (backend, "a script"))
    episodes_file = tmp_path / "episodes.txt"
    before = servers_running()
    status = main(
        ["eval", "env:Counter", "--model", str(tiny_model_dir), "--chat-template",
         "chatml_tools", "--num-episodes", "2", "--mcp-server", spec,
         "--episodes-file", str(episodes_file)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert eval_figures(out)["episodes"] == "2"
    pids = [int(pid) for pid in re.findall(r"\[tool pid\] -> (\d+)", episodes_file.read_text())]
    assert len(pids) == 2 and len(set(pids)) == servers  # shared: one; per episode: one each
    assert all(is_gone(pid) for pid in pids)
    assert servers_running() == before


def test_a_bad_mcp_server_on_eval_is_a_usage_error_naming_the_option(tiny_model_dir, capsys):
    status = main(
        ["eval", "env:Counter", "--model", str(tiny_model_dir),
         "--mcp-server", "no-such-mcp-server-command"]
    )  # fmt: skip
    assert status != 0
    assert "mcp_servers[0]: cannot start MCP server" in capsys.readouterr().err
