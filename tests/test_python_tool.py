"""The sandboxed python tool: each limit holds, the tool returns text, and the next call works.

The isolation tests (network, filesystem) need Linux user namespaces; they are skipped, with the
reason, on a machine without them. Time bounds are generous: they only say "does not hang".
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from conftest import scripted_backend, tool_call

from rollout import RolloutEngine
from tools import as_tool, call_tool, python, python_tool
from tools.sandbox import _isolation_works

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux"),
]

fast = python_tool(timeout_s=30, memory_mb=256, max_processes=16, max_output_chars=500)
looping = python_tool(timeout_s=3, max_output_chars=500)  # for programs that never end


async def assert_next_call_works(tool=fast) -> None:
    assert await tool("print('still here')") == "still here"


async def require_isolation() -> None:
    if not await _isolation_works():
        pytest.skip("user namespaces are unavailable here: the sandbox cannot isolate")


async def test_printed_output_comes_back_as_is():
    assert await python("print('hello')\nprint(6 * 7)") == "hello\n42"


async def test_an_error_returns_the_traceback_and_the_exit_status():
    result = await fast("def f():\n    return 1 / 0\nf()")
    assert result.startswith("[stderr]\nTraceback (most recent call last):")
    assert "ZeroDivisionError: division by zero" in result
    assert result.endswith("[exit status 1]")


async def test_a_program_that_prints_nothing_says_so():
    assert await fast("x = 1") == "[no output, exit status 0]"


async def test_an_infinite_loop_is_killed_by_the_wall_clock_limit():
    started = time.perf_counter()
    result = await looping("while True:\n    pass")
    assert result == "[killed: wall-clock limit 3 s]"
    assert time.perf_counter() - started < 60
    await assert_next_call_works()


async def test_a_busy_loop_is_killed_by_the_cpu_time_limit():
    cpu_bound = python_tool(timeout_s=120, cpu_s=1)
    assert await cpu_bound("while True:\n    pass") == "[killed: CPU-time limit 1 s]"
    await assert_next_call_works(cpu_bound)


async def test_a_memory_bomb_gets_a_memory_error():
    result = await fast("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))")
    assert "MemoryError" in result
    assert result.endswith("[exit status 1: MemoryError, memory limit 256 MB]")
    await assert_next_call_works()


async def test_a_fork_bomb_is_stopped_by_the_process_limit_and_leaves_nothing_behind():
    await require_isolation()
    bomb = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(1000)\n"
        "        children += 1\n"
        "except OSError as error:\n"
        "    print('fork refused after', children, 'children:', error.strerror)\n"
    )
    result = await fast(bomb)
    assert result.startswith("fork refused after ")
    assert int(result.split()[3]) < 16
    await assert_no_sandboxed_process_left()
    await assert_next_call_works()


async def assert_no_sandboxed_process_left() -> None:
    assert await anyio.to_thread.run_sync(no_sandboxed_process_within, 30.0)


def no_sandboxed_process_within(seconds: float) -> bool:
    """Killed processes take a moment to exit; whether none still runs after `seconds`."""
    deadline = time.monotonic() + seconds
    while sandboxed_processes():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def sandboxed_processes() -> list[int]:
    """Pids of processes still running sandboxed code (the interpreter on /tmp/main.py)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if argv[1:3] == [b"-u", b"/tmp/main.py"]:
            pids.append(int(entry.name))
    return pids


def escape_targets() -> list[str]:
    """A file to create in each folder outside the sandbox that the test process can write."""
    folders = ["/tmp", "/var/tmp", "/dev/shm", str(Path.cwd()), str(Path.home())]
    return [f"{folder}/sandbox-escape" for folder in folders if os.access(folder, os.W_OK)]


async def test_writes_outside_the_working_folder_are_refused():
    await require_isolation()
    targets = escape_targets()
    code = (
        f"for path in {targets!r} + ['inside.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as error:\n"
        "        print('refused', path, error.strerror)\n"
    )
    result = await fast(code)
    # Read-only everywhere; a folder under the host's /tmp (a checkout there, say) is not even
    # there, since an empty read-only tmpfs hides /tmp.
    refusals = ("Read-only file system", "No such file or directory")
    for target in targets:
        assert any(f"refused {target} {why}" in result for why in refusals), result
    assert not any(map(os.path.exists, targets))
    assert "wrote inside.txt" in result
    await assert_next_call_works()


async def test_each_call_gets_a_fresh_empty_working_folder():
    await require_isolation()
    assert await fast("open('note.txt', 'w').write('x')") == "[no output, exit status 0]"
    assert await fast("import os\nprint(os.getcwd(), os.listdir('.'))") == "/tmp/work []"


async def test_a_socket_connect_fails_inside_even_to_a_port_listening_on_the_host():
    await require_isolation()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
            "    print('connected')\n"
            "except OSError as error:\n"
            "    print('refused:', error.strerror)\n"
        )
        result = await fast(code)
    assert result == "refused: Network is unreachable"
    await assert_next_call_works()


async def test_huge_output_is_cut_with_a_marker_saying_how_much():
    result = await fast("print('x' * 1_000_000)\nimport sys\nprint('the end', file=sys.stderr)")
    stdout, stderr = result.split("\n[stderr]\n")
    shown = 500 - len("the end\n")  # stderr is short, so stdout gets the rest of the 500
    cut = len("x" * 1_000_000 + "\n") - shown
    assert stdout == "x" * shown + f"\n[... {cut} more bytes of stdout cut]"
    assert stderr == "the end"
    await assert_next_call_works()


async def test_endless_output_is_cut_and_killed_by_the_wall_clock_limit():
    result = await looping("while True:\n    print('spam' * 1000)")
    assert result.startswith("spam" * 100)
    assert "more bytes of stdout cut]" in result
    assert result.endswith("[killed: wall-clock limit 3 s]")
    await assert_next_call_works()


async def test_call_tool_validates_and_runs_it_and_its_schema_states_the_limits():
    tool = as_tool(fast)
    assert tool.name == "python"
    description = tool.schema["function"]["description"]
    assert "Limits per call: 30 s, 256 MB of memory, 500 characters of output." in description
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    result = await call_tool({"python": tool}, "python", {"code": "print(2 ** 10)"}, 30)
    assert (result.content, result.error) == ("1024", None)


async def test_a_call_tool_timeout_kills_the_program_at_once():
    slow = python_tool(timeout_s=600)
    tools = {"python": as_tool(slow)}
    code = "import time\ntime.sleep(1000)"
    result = await call_tool(tools, "python", {"code": code}, timeout_s=2)
    assert result.error == "timeout"
    await assert_no_sandboxed_process_left()


def test_bad_limits_are_refused_naming_the_limit():
    with pytest.raises(ValueError, match="memory_mb must be a positive number, got 0"):
        python_tool(memory_mb=0)
    with pytest.raises(ValueError, match="max_output_chars must be an integer of at least 100"):
        python_tool(max_output_chars=10)


async def test_an_episode_calls_the_python_tool_through_the_engine(tokenizer):
    turns = [tool_call("python", code="print(sum(range(101)))"), "The sum is 5050."]
    engine = RolloutEngine(
        scripted_backend(tokenizer, turns), tokenizer, tools=[python], chat_template="chatml_tools"
    )
    [episode] = await engine.run([{"prompt": "Add the numbers from 1 to 100."}])
    assert episode.messages[2] == {"role": "tool", "name": "python", "content": "5050"}
    assert episode.messages[3]["content"] == "The sum is 5050."
