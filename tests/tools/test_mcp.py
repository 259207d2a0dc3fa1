"""MCP servers as tools, against a real server (tests/scripts/mcp_server.py) over stdio and HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from tests.support.paths import REPO
from tools import ToolErrorKind, call_tool
from tools.mcp import McpServer, McpServerError, McpTools, mcp_servers_of

pytestmark = pytest.mark.process  # every test but the parsing ones starts a server

SERVER = str(REPO / "tests" / "scripts" / "mcp_server.py")
GONE_WITHIN_S = 30.0  # generous: only a process that never ends runs it out


def stdio(*flags: str) -> McpServer:
    return McpServer(command=(sys.executable, SERVER, *flags))


def call(mcp: McpTools, name: str, timeout_s: float = 30.0, **arguments):
    """Call a tool as an episode does, on an event loop of its own (as each round has)."""
    return anyio.run(call_tool, mcp.tools, name, arguments, timeout_s)


def server_pid(mcp: McpTools) -> int:
    return int(call(mcp, "pid").content)


def is_gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie, ended but not yet reaped, counts as gone)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def servers_running() -> set[int]:
    """The test servers this process started that still run."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and SERVER in command:
            found.add(int(entry.name))
    return found


@pytest.fixture(scope="module")
def shared():
    with McpTools([stdio()]) as mcp:
        yield mcp


# ------------------------------------------------------------------------------ the tools


def test_a_servers_tools_are_offered_with_its_descriptions_and_input_schemas(shared):
    assert list(shared.tools) == ["add", "fail", "pid", "remember", "wait"]
    function = shared.tools["add"].schema["function"]
    assert function["description"] == "Add two integers."
    assert function["parameters"]["required"] == ["a", "b"]
    assert function["parameters"]["properties"]["a"]["type"] == "integer"


def test_a_call_reaches_the_server_and_its_text_comes_back(shared):
    result = call(shared, "add", a=2, b=40)
    assert (result.content, result.error) == ("42", None)


def test_an_error_the_server_reports_is_a_message_the_model_reads(shared):
    result = call(shared, "fail", reason="because")
    assert result.error is ToolErrorKind.EXCEPTION
    assert "McpToolError" in result.content and "failed on purpose: because" in result.content


def test_arguments_are_checked_against_the_servers_schema_before_the_call(shared):
    result = call(shared, "add", a="two")
    assert result.error is ToolErrorKind.BAD_ARGUMENTS
    assert "missing required argument 'b'" in result.content


def test_a_call_past_its_timeout_times_out_and_the_session_still_answers(shared):
    assert call(shared, "wait", timeout_s=0.5, seconds=60).error is ToolErrorKind.TIMEOUT
    assert call(shared, "add", a=1, b=1).content == "2"


def test_calls_from_other_threads_and_event_loops_reach_the_one_shared_server(shared):
    first = int(call(shared, "remember", note="main thread").content)
    seen: list[str] = []
    worker = threading.Thread(
        target=lambda: seen.append(call(shared, "remember", note="worker").content)
    )
    worker.start()
    worker.join()
    assert seen == [str(first + 1)]


# ------------------------------------------------------------------------------ the servers' lives


def test_close_stops_the_server_and_a_second_close_does_nothing():
    mcp = McpTools([stdio("--linger")])  # only a signal ends it once its stdin closes
    pid = server_pid(mcp)
    mcp.close()
    assert is_gone(pid)
    mcp.close()


def test_a_server_that_exits_at_start_is_an_error_naming_it_and_quoting_its_stderr():
    with pytest.raises(McpServerError, match="refusing to start, as asked") as raised:
        McpTools([stdio("--die")])
    assert "--die" in str(raised.value) and "mcp_servers" in str(raised.value)


def test_a_server_that_does_not_answer_in_time_is_an_error_and_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    silent = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    server = McpServer(command=(sys.executable, "-c", silent, str(pid_file)))
    with pytest.raises(McpServerError, match=r"did not start and list its tools within 1\.0 s"):
        McpTools([server], timeout_s=1.0)
    assert is_gone(int(pid_file.read_text()))


def test_two_servers_offering_one_tool_name_are_refused_and_both_stopped(shared):
    before = servers_running()
    with pytest.raises(ValueError, match=r"two MCP servers .* offer a tool named 'add'"):
        McpTools([stdio(), stdio("--linger")])
    assert servers_running() == before


@pytest.mark.parametrize("ending", ["error", "interrupt"])
def test_a_process_that_fails_or_is_interrupted_takes_its_servers_with_it(ending):
    script = f"""
import os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
import anyio
from tools import call_tool
from tools.mcp import McpServer, McpTools
mcp = McpTools([McpServer(command=(sys.executable, {SERVER!r}, "--linger"))])
print(anyio.run(call_tool, mcp.tools, "pid", {{}}, 30.0).content, flush=True)
if sys.argv[1] == "interrupt":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)
raise RuntimeError("the run failed")
"""
    done = subprocess.run(
        [sys.executable, "-c", script, ending], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert ("KeyboardInterrupt" if ending == "interrupt" else "the run failed") in done.stderr
    assert is_gone(int(done.stdout.split()[0]))


def test_an_http_servers_tools_are_offered_and_called():
    process = subprocess.Popen(
        [sys.executable, SERVER, "--http"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline().split()[1])
        with McpTools([McpServer.parse(f"http://127.0.0.1:{port}/mcp")]) as mcp:
            assert "add" in mcp.tools
            assert call(mcp, "add", a=20, b=22).content == "42"
            assert call(mcp, "fail", reason="far").error is ToolErrorKind.EXCEPTION
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_an_http_server_that_does_not_answer_is_an_error_naming_it():
    with pytest.raises(McpServerError, match=r"'http://127\.0\.0\.1:9/mcp' \(mcp_servers\)"):
        McpTools([McpServer(url="http://127.0.0.1:9/mcp")])  # port 9: discard, never MCP


# ------------------------------------------------------------------------------ the specs


@pytest.mark.parametrize(
    ("spec", "server"),
    [
        ("python s.py --flag 'a b'", McpServer(command=("python", "s.py", "--flag", "a b"))),
        (" https://example.com/mcp ", McpServer(url="https://example.com/mcp")),
        (
            {"command": "python", "args": ["s.py"], "env": {"B": "2", "A": "1"}},
            McpServer(command=("python", "s.py"), env=(("A", "1"), ("B", "2"))),
        ),
        ('{"url": "http://127.0.0.1:8000/mcp"}', McpServer(url="http://127.0.0.1:8000/mcp")),
    ],
)
def test_a_spec_is_a_command_line_a_url_or_a_dict(spec, server):
    assert McpServer.parse(spec) == server


BAD_SPECS = [
    ("   ", "names no MCP server"),
    ("python 'unclosed", "cannot split"),
    ({"command": "python", "per_spisode": True}, "unknown key 'per_spisode'"),
    ({"command": "python", "per_episode": "yes"}, "'per_episode' must be true or false"),
    ({"command": "python", "url": "http://x"}, "exactly one of 'command' and 'url'"),
    ({"url": "ftp://x"}, "must be an http"),
    ({"command": "python", "args": "s.py"}, "'args' must be a list of texts"),
    ({"command": "python", "env": {"A": 1}}, "'env' must map names to texts"),
    ('{"url": ', "is not a JSON object"),
    (3, "is a int"),
    ("no-such-mcp-server-command --stdio", "'no-such-mcp-server-command' is not an executable"),
]


@pytest.mark.parametrize(("spec", "problem"), BAD_SPECS)
def test_a_bad_spec_is_refused_naming_the_option_and_its_place(spec, problem):
    with pytest.raises(ValueError, match=r"^mcp_servers\[1\]: ") as raised:
        mcp_servers_of([sys.executable, spec])
    assert problem in str(raised.value)


def test_one_spec_not_in_a_list_is_refused():
    with pytest.raises(ValueError, match=r"wrap the one given in \[\.\.\.\]"):
        mcp_servers_of("python server.py")
