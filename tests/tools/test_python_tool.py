"""The sandboxed python tool: each limit holds, the tool returns text, and the next call works.

The escape tests (environment, files, TCP and UNIX sockets, signals, children outliving the call,
memory, disk, output, fork bombs) never skip: on a machine where the sandbox cannot isolate it
refuses, and they fail saying why. Time bounds are generous: they only say "does not hang".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from rollout import RolloutEngine
from tests.support.episodes import scripted_backend, tool_call
from tests.support.paths import REPO
from tests.support.venvs import make_venv
from tools import as_tool, call_tool, python, python_tool

pytestmark = [
    pytest.mark.process,
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux"),
]

fast = python_tool(timeout_s=30, memory_mb=256, max_processes=16, max_output_chars=500)
looping = python_tool(timeout_s=3, max_output_chars=500)  # for programs that never end


async def assert_next_call_works(tool=fast) -> None:
    assert await tool("print('still here')") == "still here"


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
    folders = ["/tmp", "/var/tmp", str(Path.cwd()), str(Path.home())]  # /dev/shm: see below
    return [f"{folder}/sandbox-escape" for folder in folders if os.access(folder, os.W_OK)]


async def test_writes_outside_the_working_folder_are_refused():
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
    # Read-only everywhere; most folders of the host (its /tmp, the home folder) are not even
    # there, since the code sees only its own root.
    refusals = ("Read-only file system", "No such file or directory")
    for target in targets:
        assert any(f"refused {target} {why}" in result for why in refusals), result
    assert not any(map(os.path.exists, targets))
    assert "wrote inside.txt" in result
    await assert_next_call_works()


async def test_each_call_gets_a_fresh_empty_working_folder():
    assert await fast("open('note.txt', 'w').write('x')") == "[no output, exit status 0]"
    assert await fast("import os\nprint(os.getcwd(), os.listdir('.'))") == "/tmp/work []"


async def test_a_socket_connect_fails_inside_even_to_a_port_listening_on_the_host():
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


async def test_the_trainers_environment_is_out_of_reach(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_of_the_trainer")
    code = (
        "import os, glob\n"
        "print('env', os.environ.get('HF_TOKEN'))\n"
        "seen = []\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        if b'hf_secret' in open(path, 'rb').read():\n"
        "            seen.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
        f"print('found in', seen, os.path.exists('/proc/{os.getpid()}'))\n"
    )
    assert await fast(code) == "env None\nfound in [] False"


async def test_files_outside_the_working_folder_are_not_there(tmp_path):
    secrets = [tmp_path / "secret.txt", Path.home() / ".agentgrpo-sandbox-secret"]
    for secret in secrets:
        secret.write_text("token")
    try:
        code = f"import os\nprint([os.path.exists(p) for p in {list(map(str, secrets))!r}])"
        assert await fast(code) == "[False, False]"
    finally:
        secrets[1].unlink()


async def test_a_unix_socket_the_host_listens_on_is_out_of_reach():
    # Outside /tmp, as docker.sock is: a new network namespace alone leaves such sockets open.
    path = str(Path.home() / f".agentgrpo-test-{os.getpid()}.sock")
    with socket.socket(socket.AF_UNIX) as on_disk, socket.socket(socket.AF_UNIX) as abstract:
        on_disk.bind(path)
        abstract.bind(f"\0agentgrpo-test-{os.getpid()}")
        on_disk.listen()
        abstract.listen()
        code = (
            "import socket\n"
            f"for address in [{path!r}, {abstract.getsockname()!r}]:\n"
            "    try:\n"
            "        socket.socket(socket.AF_UNIX).connect(address)\n"
            "        print('connected')\n"
            "    except OSError as error:\n"
            "        print('refused:', error.strerror)\n"
        )
        try:
            result = await fast(code)
        finally:
            os.unlink(path)
    assert result == "refused: No such file or directory\nrefused: Connection refused"


async def test_the_code_cannot_signal_the_trainer():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        code = (
            "import os, signal\n"
            f"for pid in ({os.getpid()}, os.getppid()):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGUSR1)\n"
            "        print('sent to', pid)\n"
            "    except OSError as error:\n"
            "        print('refused:', error.strerror)\n"
        )
        result = await fast(code)
        await anyio.sleep(0.5)  # a signal that did arrive has run its handler by now
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # The parent inside is the sandbox's PID 1, which ignores signals it has no handler for.
    assert result == "refused: No such process\nsent to 1"
    assert received == []


async def test_a_disk_filler_runs_out_of_space_in_its_folder():
    small = python_tool(timeout_s=30, disk_mb=4, max_output_chars=500)
    code = (
        "written = 0\n"
        "try:\n"
        "    while True:\n"
        "        open(f'part{written}', 'wb').write(b'x' * 2**20)\n"
        "        written += 1\n"
        "except OSError as error:\n"
        "    print(written, 'MiB, then:', error.strerror)\n"
    )
    result = await small(code)
    assert result.endswith(" MiB, then: No space left on device"), result
    assert int(result.split()[0]) <= 4  # 4 MiB in all, the code and folders included
    await assert_next_call_works()


async def test_multiprocessing_works_inside_on_a_private_dev_shm():
    marker = f"agentgrpo-test-{os.getpid()}"
    code = (
        f"open('/dev/shm/{marker}', 'w').write('x')\n"
        "from multiprocessing import Pool\n"
        "with Pool(2) as pool:\n"
        "    print(pool.map(abs, [-1, -2]))\n"
    )
    assert await fast(code) == "[1, 2]"
    assert marker not in os.listdir("/dev/shm")


def sleeper_code(marker: str) -> str:
    """Code that starts a sleeper, `marker` in its command line, in a new session."""
    return (
        "import subprocess, sys\n"
        "command = [sys.executable, '-c', 'import time; time.sleep(1000)', "
        f"{marker!r}]\n"
        "sleeper = subprocess.Popen(command, start_new_session=True)\n"
        "print('started')\n"
    )


def running_with(marker: str) -> list[int]:
    """Pids of live processes (not zombies) with `marker` in their command line."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # not a process, or gone
            continue
        if marker.encode() in argv and state != "Z":
            pids.append(int(entry.name))
    return pids


async def assert_none_running_with(marker: str) -> None:
    def none_left() -> bool:
        return not running_with(marker)

    assert await anyio.to_thread.run_sync(wait_until, none_left, 30.0), running_with(marker)


async def test_a_child_that_leaves_the_session_dies_with_the_call():
    marker = f"agentgrpo-test-sleeper-{os.getpid()}-isolated"
    assert await fast(sleeper_code(marker)) == "started"
    await assert_none_running_with(marker)


@pytest.mark.skipif(os.geteuid() != 0, reason="finding a child that left the session needs root")
async def test_without_isolation_a_child_that_leaves_the_session_dies_with_the_call():
    marker = f"agentgrpo-test-sleeper-{os.getpid()}-unisolated"
    unisolated = python_tool(timeout_s=20, isolation="none")
    # Not "[killed: wall-clock limit 20 s]": the sleeper holds the output pipes until killed.
    assert await unisolated(sleeper_code(marker)) == "started"
    await assert_none_running_with(marker)
    assert leftover_cgroups() == []


UNISOLATED_SCRIPT = """
import sys
import anyio
from tools import python_tool

print(anyio.run(python_tool(timeout_s=float(sys.argv[2]), isolation="none"), sys.argv[1]))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
@pytest.mark.parametrize("timeout_s", [60, 10], ids=["code-exits", "wall-clock-kill"])
async def test_not_as_root_without_isolation_a_child_that_leaves_the_session_dies_too(timeout_s):
    # In a user namespace of its own the caller is uid 65534, with no cgroup to track children.
    marker = f"agentgrpo-test-sleeper-{os.getpid()}-not-root-{timeout_s}"
    code = sleeper_code(marker) + ("import time\ntime.sleep(1000)\n" if timeout_s == 10 else "")
    command = ["unshare", "--user", sys.executable, "-c", UNISOLATED_SCRIPT, code, str(timeout_s)]
    done = await anyio.run_process(command, env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
    ending = "started" if timeout_s == 60 else "started\n[killed: wall-clock limit 10 s]"
    assert done.stdout.decode().strip() == ending, done.stderr.decode()
    await assert_none_running_with(marker)


def wait_until(condition, seconds: float) -> bool:
    """Poll `condition` until it holds or `seconds` pass; whether it held."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def leftover_cgroups() -> list[str]:
    """This process's sandbox cgroup folders still in /sys/fs/cgroup."""
    pattern = f"**/agentgrpo-sandbox-{os.getpid()}-*"
    return [str(path) for path in Path("/sys/fs/cgroup").glob(pattern)]


ESCAPE_CODE = """
import json, os, socket
def attempt(action):
    try:
        action()
        return "done"
    except OSError as error:
        return error.strerror
print(json.dumps({
    "environ": attempt(lambda: open("/proc/%(pid)d/environ").read()),
    "signal": attempt(lambda: os.kill(%(pid)d, 0)),
    "write": attempt(lambda: open(%(outside)r, "w").write("x")),
    "tcp": attempt(lambda: socket.create_connection(("127.0.0.1", %(port)d), timeout=5)),
    "unix": attempt(lambda: socket.socket(socket.AF_UNIX).connect(%(unix)r)),
}))
"""

# Runs ESCAPE_CODE (argv[2]) in the python tool against this process's pid, a TCP and a UNIX
# socket it listens on, and a file to create (argv[1]); prints the code's report.
ESCAPES_SCRIPT = """
import os, socket, sys
import anyio
from tools import python_tool

outside, code = sys.argv[1:]
with socket.create_server(("127.0.0.1", 0)) as server, socket.socket(socket.AF_UNIX) as unix:
    unix.bind(outside + ".sock")
    unix.listen()
    port = server.getsockname()[1]
    values = {"pid": os.getpid(), "outside": outside, "port": port, "unix": outside + ".sock"}
    print(anyio.run(python_tool(timeout_s=60), code % values))
"""


@pytest.fixture(scope="module")
def venv_under_tmp() -> Iterator[Path]:
    """A virtual environment under /tmp (as CI images have), seeing this one's packages."""
    folder = Path("/tmp") / f"agentgrpo-test-venv-{os.getpid()}"
    make_venv(folder)
    yield folder
    shutil.rmtree(folder)


def test_the_sandbox_isolates_when_the_interpreter_lives_under_tmp(venv_under_tmp, tmp_path):
    outside = tmp_path / "escaped.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_TOKEN="hf_secret")
    done = subprocess.run(
        [str(venv_under_tmp / "bin" / "python"), "-c", ESCAPES_SCRIPT, str(outside), ESCAPE_CODE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "environ": "No such file or directory",
        "signal": "No such process",
        "write": "No such file or directory",
        "tcp": "Network is unreachable",
        "unix": "No such file or directory",
    }
    assert not outside.exists()


REFUSAL_SCRIPT = """
import anyio
from tools import SandboxUnavailableError, as_tool, call_tool, python, python_tool

async def main():
    try:
        await call_tool({"python": as_tool(python)}, "python", {"code": "print(1)"}, 60)
    except SandboxUnavailableError as error:
        print("refused:", error)
    print(await python_tool(isolation="none")("print('limits only')"))

anyio.run(main)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_a_sandbox_that_cannot_isolate_refuses_unless_told_isolation_none():
    # Inside a user namespace that may make no further ones, isolation is impossible.
    forbid = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"'
    shell = ["unshare", "--user", "--map-root-user", "sh", "-c", forbid]
    done = subprocess.run(
        [*shell, sys.executable, REFUSAL_SCRIPT],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    refusal, unisolated = done.stdout.strip().split("\n")
    assert refusal.startswith("refused: the Python sandbox cannot isolate code on this machine")
    assert "unshare: No space left on device" in refusal
    assert "pass isolation='none'" in refusal
    assert unisolated == "limits only"


def test_an_unknown_isolation_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"isolation must be one of \('namespaces', 'none'\)"):
        python_tool(isolation="off")


KEYCTL_CODE = """
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
keyctl = {"x86_64": 250, "aarch64": 219}[platform.machine()]
found = libc.syscall(keyctl, 10, -3, b"user", b"agentgrpo-test-key", 0)  # KEYCTL_SEARCH @s
if found < 0:
    print("not found:", ctypes.get_errno())
else:
    buffer = ctypes.create_string_buffer(64)
    size = libc.syscall(keyctl, 11, found, buffer, 64)  # KEYCTL_READ
    print("read:", buffer.raw[: max(size, 0)])
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="keyctl numbers")
@pytest.mark.parametrize("isolation", ["namespaces", "none"])
async def test_the_callers_session_keyring_is_out_of_reach(isolation):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    add_key = {"x86_64": 248, "aarch64": 217}[os.uname().machine]
    secret = b"trainer-secret"
    key = libc.syscall(add_key, b"user", b"agentgrpo-test-key", secret, len(secret), -3)
    assert key > 0, f"add_key failed: {os.strerror(ctypes.get_errno())}"
    try:
        result = await python_tool(timeout_s=30, isolation=isolation)(KEYCTL_CODE)
        listed = await python_tool(timeout_s=30)("print(open('/proc/keys').read() or 'empty')")
    finally:
        libc.syscall({"x86_64": 250, "aarch64": 219}[os.uname().machine], 3, key)  # revoke
    assert result.startswith("not found:") and "trainer-secret" not in result
    assert listed == "empty"  # isolated, not even the keys' descriptions are listed


CALLER_SCRIPT = """
import sys
import anyio
from tools import python_tool

anyio.run(python_tool(timeout_s=300, isolation=sys.argv[2]), sys.argv[1])
"""


@pytest.mark.parametrize("isolation", ["namespaces", "none"])
async def test_a_call_ends_with_its_caller_killed_by_sigkill_and_its_folder_goes_later(isolation):
    marker = f"agentgrpo-test-sleeper-{os.getpid()}-orphaned-{isolation}"
    code = sleeper_code(marker) + "import time\ntime.sleep(1000)\n"
    command = [sys.executable, "-c", CALLER_SCRIPT, code, isolation]
    caller = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=str(REPO)))  # noqa: ASYNC220
    try:
        started = await anyio.to_thread.run_sync(wait_until, lambda: running_with(marker), 60.0)
        assert started, "the sandboxed code never started"
        folders = call_folders_of(caller.pid)
        assert folders, "the call holds no folder"
        caller.kill()  # SIGKILL: nothing of the caller's runs after it
        caller.wait()
        await assert_none_running_with(marker)  # the call ended with its caller
    finally:
        caller.kill()
    await anyio.to_thread.run_sync(
        subprocess.run,
        [sys.executable, "-c", CALLER_SCRIPT, "print(1)", isolation],
    )
    assert call_folders_of(caller.pid) == []  # a later process's first call removed it


def call_folders_of(pid: int) -> list[Path]:
    """The sandbox call folders of process `pid` in the temporary folder."""
    import tempfile

    return sorted(Path(tempfile.gettempdir()).glob(f"agentgrpo-python-{pid}-*"))
