"""Run untrusted Python in a child process under limits, isolated or refused.

`await run_python(code, limits)` never raises for anything the code does: a limit hit, a crash
or a traceback is reported in the returned `SandboxRun`. It is async, so waiting never blocks
the event loop, and a cancelled call (e.g. `call_tool`'s timeout) kills the child at once.

What holds on every Linux machine, per call:

- wall clock: after `timeout_s` the whole process group is killed (SIGKILL);
- CPU time: RLIMIT_CPU (SIGXCPU at `cpu_s`, SIGKILL a second later);
- memory: RLIMIT_AS of `memory_mb` per process (Python raises MemoryError);
- memory the kernel holds for the code, which RLIMIT_AS does not count: at most
  `max_open_files` open files per process (RLIMIT_NOFILE: pipes, sockets and their buffers),
  and no `memfd_create` (refused with EPERM by a seccomp filter: a file in memory that no
  mapping counts);
- file size: RLIMIT_FSIZE of `disk_mb` per file; no core dumps;
- output: at most `max_output_chars` characters come back, with a marker saying what was cut;
  the rest is read and thrown away, so the host's memory stays bounded;
- environment: only the variables in `_CODE_ENV` (no tokens or keys leak through it); stdin is
  empty;
- keys: a new, empty session keyring: the caller's session keys can be neither searched nor
  read (isolated, `/proc/keys` lists none of the caller's either);
- as root, where a hierarchy of each is writable, cgroups for the whole call: a pids cgroup of
  `max_processes` and a memory cgroup of `memory_mb + disk_mb` (+ `SUPERVISOR_MB` for the
  sandbox's own processes) that counts what the kernel holds too (pipes, files in memory,
  page tables). `check_machine` says once, in words, which of them cannot be had here;
- when the code's process ends, or the call does, everything it started ends too, processes
  that left its session included: with the PID namespace when isolated, by a subreaper when
  not, and as root also by killing every process in the call's cgroups, then removed;
- when the caller dies, even by SIGKILL (the OOM killer, `kill -9`), the call ends too: the
  child gets SIGTERM from the kernel (`PR_SET_PDEATHSIG`) and ends as at a deadline, and has a
  deadline of its own, `timeout_s` + `DEADLINE_GRACE_S`, should the caller be stuck. The call
  folders and cgroups a dead caller left are removed by the next process's first call.

Isolation (`isolation="namespaces"`, the default; see `tools/_sandbox_child.py` for the steps),
through Linux user namespaces:

- a new root holding only the working folder `/tmp/work` and `/dev/shm` (the only writable
  places, on a tmpfs of `disk_mb` gone after the call), the code, a few devices, a fresh `/proc`,
  and read-only system folders (`_SYSTEM_PATHS`) and the interpreter's prefixes and
  site-packages, bound at their own paths (so a venv under `/tmp` works). The rest of the
  host's files, sockets on the filesystem (`docker.sock`, a trainer's) included, is not there;
- no network: a new network namespace with no device up, which also cuts off abstract UNIX
  sockets;
- a fresh PID namespace: no other process can be seen or signalled, and all of the call's die
  with it;
- no capabilities, no nested namespaces, and at most `max_processes` processes: through a pids
  cgroup when running as root (root ignores RLIMIT_NPROC), through RLIMIT_NPROC otherwise
  (counted per user namespace since Linux 5.14).

Whether isolation works is probed once per process. Where it does not, every call raises
`SandboxUnavailableError` saying why; it never runs the code with less than was asked for.
`isolation="none"` runs it with the limits above only, and only when asked for by name: the
code then reads and writes what this process's user can, uses the network, and signals this
user's processes (its subreaper among them: killing that first lets its children outlive the
call, unless root's cgroup finds them).

Not guaranteed: reading the visible paths (`/etc` among them). Without a memory cgroup, memory
is limited per process, so up to `max_processes * memory_mb` in all, plus the buffers of
`max_open_files` pipes and sockets per process. A kernel bug is not defended against: this is a
guard against mistakes and runaway code, not a jail for a determined attacker.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import os
import signal
import site
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from tools._sandbox_host import (
    CallCgroups,
    call_cgroups,
    call_folder,
    cgroup_gaps,
    remove_leftovers,
)

logger = logging.getLogger(__name__)
_CHILD_SCRIPT = str(Path(__file__).with_name("_sandbox_child.py"))
_CODE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",  # thread pools count as processes against max_processes
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_SYSTEM_PATHS = {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"}
_KILL_ROUNDS = 1000  # rounds of killing a cgroup's processes; each round has fewer to kill
_TERM_GRACE_S = 10.0  # a child told to end takes milliseconds; this only bounds a stuck one
# Seconds past `timeout_s` after which the child ends the call itself (the caller is stuck).
DEADLINE_GRACE_S = 10
SUPERVISOR_MB = 64  # the memory cgroup's room for the sandbox's own two Python processes


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    Attributes:
        timeout_s: Wall-clock limit in seconds.
        cpu_s: CPU-time limit in whole seconds; None means `ceil(timeout_s)`.
        memory_mb: Address-space limit per process, in MiB.
        max_processes: Processes and threads the code may have at once (isolated runs only).
        disk_mb: Size of the working folder, and of any one file written, in MiB.
        max_output_chars: Characters of stdout plus stderr returned; the rest is cut.
        max_open_files: Files, pipes and sockets each process may have open at once.

    """

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_mb: int = 1024
    max_processes: int = 64
    disk_mb: int = 64
    max_output_chars: int = 10_000
    max_open_files: int = 128

    def __post_init__(self) -> None:
        """Refuse limits that are not positive numbers, naming the bad one."""
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_processes", "disk_mb"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.max_output_chars, int) or self.max_output_chars < 100:
            raise ValueError(
                f"max_output_chars must be an integer of at least 100, got "
                f"{self.max_output_chars!r}"
            )
        if not isinstance(self.max_open_files, int) or self.max_open_files < 16:
            raise ValueError(
                f"max_open_files must be an integer of at least 16 (Python itself opens "
                f"several), got {self.max_open_files!r}"
            )

    @property
    def call_memory_bytes(self) -> int:
        """The memory cgroup's limit: the code's memory and disk, and the supervisors'."""
        return (self.memory_mb + self.disk_mb + SUPERVISOR_MB) << 20

    @property
    def cpu_limit_s(self) -> int:
        """The CPU-time limit in whole seconds."""
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s)


@dataclass(frozen=True)
class SandboxRun:
    """How one run ended.

    Attributes:
        stdout: What the code printed, cut to fit the output limit (the head is kept).
        stderr: What it wrote to stderr, tracebacks included, cut (the tail is kept).
        stdout_cut_bytes: Bytes of stdout not returned.
        stderr_cut_bytes: Bytes of stderr not returned.
        exit_code: The exit status, or minus the signal number that killed the code.
        timed_out: Whether the wall-clock limit killed it.
        seconds: Wall time of the run, start-up included.

    """

    stdout: str
    stderr: str
    stdout_cut_bytes: int
    stderr_cut_bytes: int
    exit_code: int
    timed_out: bool
    seconds: float


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot isolate code on this machine and isolation was not turned off.

    A setup problem of the user's, not of the model's: `tools.call_tool` lets it propagate.
    """


async def run_python(code: str, limits: SandboxLimits, isolation: str = "namespaces") -> SandboxRun:
    """Run `code` as a Python program in a sandbox and report how it ended.

    Args:
        code: The program's source.
        limits: What it may use.
        isolation: `"namespaces"` (isolate as the module docstring says, or refuse) or `"none"`
            (the limits only: the code can read and write what this process's user can, use
            the network and signal this user's processes).

    Returns:
        Its output and how it ended; a limit hit is a normal result, never an exception.

    Raises:
        SandboxUnavailableError: `isolation="namespaces"` on a machine where it does not work.
        ValueError: `isolation` is neither of those.

    """
    return await _run(code, limits, isolated=await _isolation_required(isolation))


async def _run(code: str, limits: SandboxLimits, isolated: bool) -> SandboxRun:
    """Run `code` in a sandbox of its own: cgroups when root, a folder, the child."""
    remove_leftovers()
    max_tasks = limits.max_processes + 2  # + the 2 supervisors
    async with call_cgroups(max_tasks, limits.call_memory_bytes) as cgroups:
        with call_folder(isolated, code) as folder:
            config = _child_config(isolated, cgroups, limits, folder)
            return await _execute(code.encode(), config, limits, cgroups)


def _child_config(
    isolated: bool, cgroups: CallCgroups, limits: SandboxLimits, folder: str
) -> dict[str, Any]:
    """What `_sandbox_child.py` reads: the limits, and where the code lives (`call_folder`)."""
    return {
        "isolate": isolated,
        "cgroup_procs": [str(cgroup / "cgroup.procs") for cgroup in cgroups.folders],
        "cpu_s": limits.cpu_limit_s,
        "caller_pid": os.getpid(),
        "deadline_s": math.ceil(limits.timeout_s) + DEADLINE_GRACE_S,
        "memory_bytes": limits.memory_mb << 20,
        "max_processes": limits.max_processes + 2,
        "max_open_files": limits.max_open_files,
        "disk_bytes": limits.disk_mb << 20,
        "python": sys.executable,
        "env": _CODE_ENV,
        "root": folder,
        "visible": _visible_paths(),
        "workdir": os.path.join(folder, "work"),
        "script": os.path.join(folder, "main.py"),
    }


def _visible_paths() -> list[str]:
    """The host paths bound read-only into an isolated run: system folders and the interpreter.

    The interpreter's prefixes and site-packages may live anywhere (a venv under `/tmp`, pyenv
    under the home folder); each is bound at its own path, so `sys.executable` runs as is.
    """
    interpreter = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    interpreter |= set(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        interpreter.add(site.getusersitepackages())
    paths = sorted(_SYSTEM_PATHS | {os.path.abspath(path) for path in interpreter})
    inside = lambda path, folder: path.startswith(folder.rstrip("/") + "/")  # noqa: E731
    return [path for path in paths if not any(inside(path, other) for other in paths)]


async def _execute(
    code: bytes, config: dict[str, Any], limits: SandboxLimits, cgroups: CallCgroups
) -> SandboxRun:
    """Start the child, feed it the code, collect capped output until it ends or times out.

    When the code's process ends, everything it started is killed (`_kill_tree`), so a child
    that left its session can neither outlive the call nor hold the output pipes open.
    """
    start_s = time.perf_counter()
    command = [sys.executable, "-I", _CHILD_SCRIPT]  # the config goes first on stdin
    process = await anyio.open_process(command, env=_CODE_ENV, start_new_session=True)
    limit_bytes = 4 * limits.max_output_chars  # enough bytes for that many UTF-8 characters
    stdout, stderr = _Capture(limit_bytes, keep_tail=False), _Capture(limit_bytes, keep_tail=True)
    exited = False
    try:
        with anyio.move_on_after(limits.timeout_s):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_feed, process, json.dumps(config).encode() + b"\n" + code)
                tasks.start_soon(stdout.drain, process.stdout)
                tasks.start_soon(stderr.drain, process.stderr)
                await process.wait()
                exited = True
                await _kill_tree(process.pid, cgroups)  # what it left would hold the pipes open
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(process, cgroups)
            await process.aclose()
    assert process.returncode is not None  # aclose() waited for the process to exit
    stdout_text, stdout_cut, stderr_text, stderr_cut = _fit(stdout, stderr, limits.max_output_chars)
    return SandboxRun(
        stdout=stdout_text,
        stderr=stderr_text,
        stdout_cut_bytes=stdout_cut,
        stderr_cut_bytes=stderr_cut,
        exit_code=process.returncode,
        timed_out=not exited,
        seconds=time.perf_counter() - start_s,
    )


async def _feed(process: anyio.abc.Process, code: bytes) -> None:
    """Write the config line and the code to the child's stdin and close it.

    A child that died early is fine.
    """
    assert process.stdin is not None
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdin.send(code)
    await process.stdin.aclose()


async def _stop(process: anyio.abc.Process, cgroups: CallCgroups) -> None:
    """End the child and all the code started: SIGTERM first, then SIGKILL to every one.

    SIGTERM lets an unisolated child kill what the code left (see `_sandbox_child`); an
    isolated one just dies, and its PID namespace with it.
    """
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        with anyio.move_on_after(_TERM_GRACE_S):
            await process.wait()
    await _kill_tree(process.pid, cgroups)


async def _kill_tree(pgid: int, cgroups: CallCgroups) -> None:
    """SIGKILL the child's process group (it leads a new session) and everything in `cgroups`.

    The cgroups hold every process the code started, those that left the session included;
    new ones may be forked while we kill, so this repeats until they are empty.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for _ in range(_KILL_ROUNDS):
        pids = cgroups.procs()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        await anyio.sleep(0.01)


class _Capture:
    """Read a stream to its end, keeping its first (or last) `limit_bytes` bytes."""

    def __init__(self, limit_bytes: int, keep_tail: bool) -> None:
        self.limit_bytes = limit_bytes
        self.keep_tail = keep_tail
        self.kept = b""
        self.total_bytes = 0

    async def drain(self, stream: anyio.abc.ByteReceiveStream | None) -> None:
        """Read `stream` until it closes."""
        assert stream is not None
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                self.add(await stream.receive())

    def add(self, chunk: bytes) -> None:
        """Count `chunk` and keep what fits."""
        self.total_bytes += len(chunk)
        if self.keep_tail:
            self.kept = (self.kept + chunk)[-self.limit_bytes :]
        else:
            self.kept += chunk[: self.limit_bytes - len(self.kept)]

    def chars(self) -> int:
        """How many characters the kept bytes decode to."""
        return len(self.kept.decode(errors="replace"))

    def text(self, keep_chars: int) -> tuple[str, int]:
        """The kept text cut to `keep_chars` characters, and how many bytes were cut."""
        text = self.kept.decode(errors="replace")
        if len(text) > keep_chars:
            text = text[len(text) - keep_chars :] if self.keep_tail else text[:keep_chars]
        return text, max(self.total_bytes - len(text.encode()), 0)


def _fit(stdout: _Capture, stderr: _Capture, budget_chars: int) -> tuple[str, int, str, int]:
    """Share the output limit: stderr keeps at least half of it if it needs that."""
    stderr_chars = min(stderr.chars(), max(budget_chars - stdout.chars(), budget_chars // 2))
    return (*stdout.text(budget_chars - stderr_chars), *stderr.text(stderr_chars))


_ISOLATIONS = ("namespaces", "none")
_isolation_failure: str | None = None  # why isolation does not work here; "" when it does


def check_isolation(isolation: str) -> None:
    """Raise ValueError unless `isolation` is one of `"namespaces"` and `"none"`."""
    if isolation not in _ISOLATIONS:
        raise ValueError(f"isolation must be one of {_ISOLATIONS}, got {isolation!r}")


def check_machine(isolation: str) -> None:
    """Say at start-up what the sandbox cannot hold on this machine, before any call is made.

    Logs a warning, once per process, for each limit that cannot be had here (`cgroup_gaps`),
    and probes isolation as the first call would (once per process, in a thread of its own).

    Raises:
        SandboxUnavailableError: `isolation="namespaces"` on a machine where it does not work.
        ValueError: `isolation` is neither `"namespaces"` nor `"none"`.
    """
    check_isolation(isolation)
    _warn_of_gaps()
    if isolation == "namespaces":
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            failure = thread.submit(anyio.run, _isolation_failure_here).result()
        if failure:
            raise _unavailable(failure)


@functools.cache
def _warn_of_gaps() -> None:
    for gap in cgroup_gaps():
        logger.warning("the python tool's sandbox: %s.", gap)


async def _isolation_required(isolation: str) -> bool:
    """Whether to isolate this call; raise if isolation is asked for and cannot be had."""
    check_isolation(isolation)
    _warn_of_gaps()
    if isolation == "none":
        return False
    failure = await _isolation_failure_here()
    if failure:
        raise _unavailable(failure)
    return True


def _unavailable(failure: str) -> SandboxUnavailableError:
    """The error for a machine where isolation fails with `failure`, with what to do."""
    return SandboxUnavailableError(
        f"the Python sandbox cannot isolate code on this machine ({failure}). It needs "
        "Linux user namespaces (check `unshare --user --map-root-user --mount --net --pid "
        "--fork true`; on Ubuntu, AppArmor's kernel.apparmor_restrict_unprivileged_userns "
        "may forbid them). To run model-written code with time, memory and output limits "
        "only, knowing it can then read this process's files and secrets, write anywhere "
        "this user can and use the network, pass isolation='none' (e.g. "
        "python_tool(isolation='none'))."
    )


async def _isolation_failure_here() -> str:
    """Why the sandbox cannot isolate on this machine, or "" if it can; probed once."""
    global _isolation_failure
    if _isolation_failure is None:
        limits = SandboxLimits(timeout_s=60, memory_mb=1024, max_processes=16, disk_mb=1)
        probe = await _run("", limits, isolated=True)
        failure = probe.stderr.strip() or f"exit status {probe.exit_code}"
        _isolation_failure = "" if probe.exit_code == 0 else failure
    return _isolation_failure
