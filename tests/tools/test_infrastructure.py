"""Infrastructure failures are let through by the tools layer, never shown to the model."""

from __future__ import annotations

import os
import signal
import sys

import anyio
import pytest

from tests.support.paths import REPO
from tests.tools.test_mcp import is_gone
from tools import InfrastructureError, ToolErrorKind, as_tool, call_tool, infrastructure_failure


def sandbox_gone(x: int) -> int:
    """A tool whose sandbox died.

    Args:
        x: Ignored.
    """
    raise InfrastructureError("the sandbox was preempted")


def broken(x: int) -> int:
    """A tool with a bug.

    Args:
        x: Ignored.
    """
    raise RuntimeError("boom")


TOOLS = {t.name: t for t in map(as_tool, [sandbox_gone, broken])}


def test_call_tool_lets_an_infrastructure_error_through_instead_of_telling_the_model():
    with pytest.raises(InfrastructureError, match="preempted"):
        anyio.run(call_tool, TOOLS, "sandbox_gone", {"x": 1}, 5.0)


def test_any_other_exception_in_a_tool_is_still_a_message_for_the_model():
    result = anyio.run(call_tool, TOOLS, "broken", {"x": 1}, 5.0)
    assert result.error is ToolErrorKind.EXCEPTION
    assert result.content == "Error: broken() raised RuntimeError: boom"


def wrapped(cause: BaseException) -> RuntimeError:
    try:
        raise RuntimeError("Game.reset() raised it") from cause
    except RuntimeError as error:
        return error


def test_an_infrastructure_failure_is_found_behind_the_errors_that_wrap_it():
    down = InfrastructureError("server gone")
    assert infrastructure_failure(down) is down
    assert infrastructure_failure(wrapped(wrapped(down))) is down
    assert infrastructure_failure(ExceptionGroup("calls", [wrapped(down)])) is down


def test_what_merely_happened_during_one_or_beside_one_is_not_an_infrastructure_failure():
    context = RuntimeError("raised while handling")
    context.__context__ = InfrastructureError("server gone")  # not its cause
    assert infrastructure_failure(context) is None
    mixed = ExceptionGroup("calls", [InfrastructureError("gone"), ValueError("user bug")])
    assert infrastructure_failure(mixed) is None  # the user's bug stays loud
    assert infrastructure_failure(ValueError("bad row")) is None


@pytest.mark.process  # starts a real MCP server
def test_a_call_to_an_mcp_server_that_died_raises_an_infrastructure_error():
    from tools.mcp import McpServer, McpTools

    server = McpServer(command=(sys.executable, str(REPO / "tests" / "scripts" / "mcp_server.py")))
    with McpTools([server]) as mcp:
        pid = int(anyio.run(call_tool, mcp.tools, "pid", {}, 30.0).content)
        os.kill(pid, signal.SIGKILL)  # the server this test started
        assert is_gone(pid)
        with pytest.raises(InfrastructureError, match=r"add\(\): the server is gone"):
            anyio.run(call_tool, mcp.tools, "add", {"a": 1, "b": 2}, 30.0)
