"""The sandbox against memory the kernel holds, its supervisors, and what a machine lacks.

Each probe is what the issue's attacker ran: memory files and socket buffers that RLIMIT_AS does
not count, processes that together pass one process's limit, signals to the supervisor, the
supervisor's command line. Time bounds only say "does not hang".
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from rollout import RolloutEngine
from tests.support.episodes import scripted_backend
from tools import _sandbox_host, python_tool, sandbox
from tools.sandbox import SandboxLimits, run_python

pytestmark = [
    pytest.mark.process,
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux"),
]

ISOLATIONS = ["namespaces", "none"]

MEMORY_FILES = """
import os
made = 0
try:
    for _ in range(64):
        fd = os.memfd_create("hoard")
        os.write(fd, b"x" * (15 << 20))
        made += 1
    print("made", made)
except OSError as error:
    print("refused after", made, error.strerror)
"""


@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_memory_files_are_refused(isolation):
    """Under memory_mb=256, disk_mb=16: 64 memory files of 15 MB held 960 MB of the host's."""
    limits = SandboxLimits(timeout_s=60, memory_mb=256, disk_mb=16, max_processes=16)
    run = await run_python(MEMORY_FILES, limits, isolation)
    assert run.stdout.strip() == "refused after 0 Operation not permitted", run.stderr


SOCKET_BUFFERS = """
import socket
pairs = []
try:
    for _ in range(3000):
        left, right = socket.socketpair()
        left.setblocking(False)
        try:
            while True:
                left.send(b"x" * 65536)
        except BlockingIOError:
            pass
        pairs.append((left, right))
    print("pairs", len(pairs))
except OSError as error:
    print("stopped", len(pairs), error.strerror)
"""


@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_socket_buffers_are_bounded_by_the_open_files_limit(isolation):
    """3,000 filled socket pairs held 667 MB under memory_mb=128; now 32 files per process."""
    limits = SandboxLimits(timeout_s=60, memory_mb=128, max_processes=16, max_open_files=32)
    run = await run_python(SOCKET_BUFFERS, limits, isolation)
    stopped, count, reason = run.stdout.split(" ", 2)
    assert (stopped, reason.strip()) == ("stopped", "Too many open files"), run.stdout + run.stderr
    assert int(count) < 16  # two files a pair, under 32 with Python's own


def test_the_open_files_limit_is_checked():
    with pytest.raises(ValueError, match="max_open_files must be an integer of at least 16"):
        SandboxLimits(max_open_files=4)


PROCESSES_TOGETHER = """
import json, os
ready_r, ready_w = os.pipe()  # each child says it holds its memory
go_r, go_w = os.pipe()  # closed once every child said so: then they let go
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        block = bytearray(100 << 20)  # each under the 200 MB a process may map
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(ready_w, b"x")
        os.close(ready_w)
        os.read(go_r, 1)  # held until the others hold theirs (or were killed)
        os._exit(0)
    children.append(pid)
os.close(ready_w)
os.close(go_r)
while os.read(ready_r, 1):  # ends when every child wrote and closed, or died
    pass
os.close(go_w)
statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print(json.dumps(statuses))
"""


def memory_cgroup_here() -> bool:
    return os.geteuid() == 0 and _sandbox_host._cgroup_parent("memory") is not None


@pytest.mark.skipif(not memory_cgroup_here(), reason="needs root and a writable memory cgroup")
@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_a_memory_cgroup_holds_the_whole_call(isolation):
    """Four processes of 100 MB each stay under each one's limit, and over the call's."""
    limits = SandboxLimits(timeout_s=60, memory_mb=200, disk_mb=8, max_processes=16)
    assert limits.call_memory_bytes == (200 + 8 + sandbox.SUPERVISOR_MB) << 20
    run = await run_python(PROCESSES_TOGETHER, limits, isolation)
    statuses = json.loads(run.stdout) if run.stdout else [run.exit_code]
    assert -9 in statuses, f"all four fitted: {statuses} {run.stderr}"
    assert leftover_cgroups() == []


def leftover_cgroups() -> list[str]:
    pattern = f"**/agentgrpo-sandbox-{os.getpid()}-*"
    return [str(path) for path in Path("/sys/fs/cgroup").glob(pattern)]


@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_the_codes_sigint_to_its_supervisor_is_no_setup_failure(isolation):
    supervisor = "1" if isolation == "namespaces" else "os.getppid()"
    code = f"import os, signal, time\nos.kill({supervisor}, signal.SIGINT)\ntime.sleep(1)\nprint(7)"
    run = await run_python(code, SandboxLimits(timeout_s=60), isolation)
    assert (run.stdout, run.exit_code) == ("7\n", 0), run.stderr
    assert "sandbox setup failed" not in run.stderr


async def test_the_supervisors_command_line_shows_no_host_folder_nor_config():
    code = "print(open('/proc/1/cmdline').read().replace(chr(0), ' '))"
    run = await run_python(code, SandboxLimits(timeout_s=60), "namespaces")
    assert run.exit_code == 0, run.stderr
    assert "agentgrpo-python-" not in run.stdout and "{" not in run.stdout, run.stdout


def test_what_a_machine_lacks_is_said_in_words(monkeypatch):
    monkeypatch.setattr(_sandbox_host.os, "geteuid", lambda: 0)
    monkeypatch.setattr(_sandbox_host, "_cgroup_parent", lambda controller: None)
    pids_gap, memory_gap = _sandbox_host.cgroup_gaps()
    assert pids_gap.startswith("max_processes is not enforced: this process runs as root")
    assert "--cgroupns=private" in pids_gap
    assert memory_gap.startswith("memory_mb bounds each process, not the call")
    monkeypatch.setattr(_sandbox_host.os, "geteuid", lambda: 1000)
    assert _sandbox_host.cgroup_gaps() == []  # RLIMIT_NPROC binds another user


def engine_with(tokenizer, tool) -> RolloutEngine:
    backend = scripted_backend(tokenizer, [])
    return RolloutEngine(backend, tokenizer, tools=[tool], chat_template="chatml_tools")


def test_the_engine_checks_the_machine_for_a_sandboxed_tool_once_at_start_up(
    tokenizer, monkeypatch, caplog
):
    monkeypatch.setattr(sandbox, "cgroup_gaps", lambda: ["max_processes is not enforced: why"])
    sandbox._warn_of_gaps.cache_clear()
    tool = python_tool(timeout_s=30)
    with caplog.at_level(logging.WARNING, logger="tools.sandbox"):
        engine_with(tokenizer, tool)
        engine_with(tokenizer, tool)
    sandbox._warn_of_gaps.cache_clear()
    said = [r.getMessage() for r in caplog.records if r.name == "tools.sandbox"]
    assert said == ["the python tool's sandbox: max_processes is not enforced: why."]


def test_a_machine_that_cannot_isolate_is_refused_when_the_engine_is_built(tokenizer, monkeypatch):
    monkeypatch.setattr(sandbox, "_isolation_failure", "unshare: Operation not permitted")
    with pytest.raises(sandbox.SandboxUnavailableError, match="unshare: Operation not permitted"):
        engine_with(tokenizer, python_tool())
    engine_with(tokenizer, python_tool(isolation="none"))
