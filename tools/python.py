"""A built-in tool that runs model-written Python in a sandbox (see `tools.sandbox`).

`python` is ready to pass as `tools=[python]`; `python_tool(timeout_s=..., memory_mb=...)` makes
one with other limits. The tool is async: the engine awaits it, and a cancelled call kills the
program at once. Whatever the program does (loops for ever, eats memory, forks without end,
prints gigabytes, raises) the tool returns text for the model, never an exception:

    <stdout, cut to fit with "[... N more bytes of stdout cut]">
    [stderr]
    <stderr's end, e.g. a traceback>
    [exit status 1] | [killed: wall-clock limit 10 s] | [killed: CPU-time limit 10 s] | ...

A clean run (exit status 0) with output returns just the output; one with no output at all
returns `[no output, exit status 0]`. The one exception is the user's, not the program's: on a
machine where the sandbox cannot isolate, every call raises `SandboxUnavailableError`, unless
the tool was made with `isolation="none"`.

The tool carries `check_machine` (no arguments), which the rollout engine calls once when it is
built, before any model code runs: it raises that error at start-up, and logs a warning for
each limit this machine cannot hold (`tools.sandbox.check_machine`).
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Awaitable, Callable

from tools.sandbox import SandboxLimits, SandboxRun, check_isolation, check_machine, run_python

_DESCRIPTION = """Run a Python 3 program in a sandbox and return what it printed.

Only stdout and stderr come back, so print every result you need. Each call is a fresh
process in a fresh, empty working folder: nothing is kept between calls. Network access and
writes outside the working folder may be refused.
Limits per call: {timeout_s:g} s, {memory_mb} MB of memory, {max_output_chars} characters of output.

Args:
    code: The complete program, e.g. "import math\\nprint(math.factorial(20))".

Returns:
    The program's output, its errors, and how it ended if not cleanly.
"""


def python_tool(
    timeout_s: float = 10.0,
    cpu_s: int | None = None,
    memory_mb: int = 1024,
    max_processes: int = 64,
    disk_mb: int = 64,
    max_output_chars: int = 10_000,
    isolation: str = "namespaces",
    max_open_files: int = 128,
) -> Callable[[str], Awaitable[str]]:
    """Make a `python` tool with these limits (see `SandboxLimits` for each).

    Args:
        timeout_s: Wall-clock limit per call, in seconds.
        cpu_s: CPU-time limit per call in whole seconds; None means `ceil(timeout_s)`.
        memory_mb: Address-space limit per process, in MiB.
        max_processes: Processes and threads the program may have at once.
        disk_mb: Size of the working folder, and of any one file, in MiB.
        max_output_chars: Characters of output returned to the model.
        isolation: `"namespaces"`: isolate each call (see `tools.sandbox`), and raise
            `SandboxUnavailableError` from the first call on a machine where that does not
            work. `"none"`: the limits only; the code can read your files and secrets.
        max_open_files: Files, pipes and sockets each process may have open at once.

    Returns:
        An async tool function named `python` taking `code: str`; its description (what the
        model reads) states the limits. Its `check_machine()` checks this machine for it.

    Raises:
        ValueError: If a limit is not a positive number, or `isolation` is neither value.

    """
    limits = SandboxLimits(
        timeout_s, cpu_s, memory_mb, max_processes, disk_mb, max_output_chars, max_open_files
    )
    check_isolation(isolation)

    async def python(code: str) -> str:
        return format_run(await run_python(code, limits, isolation), limits)

    python.check_machine = functools.partial(check_machine, isolation)  # type: ignore[attr-defined]

    python.__doc__ = _DESCRIPTION.format(
        timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars
    )
    return python


def format_run(run: SandboxRun, limits: SandboxLimits) -> str:
    """Render a run as the tool message the model reads (format in the module docstring)."""
    parts = []
    if run.stdout or run.stdout_cut_bytes:
        cut = f"\n[... {run.stdout_cut_bytes} more bytes of stdout cut]"
        parts.append(run.stdout.rstrip("\n") + (cut if run.stdout_cut_bytes else ""))
    if run.stderr or run.stderr_cut_bytes:
        cut = f"[... {run.stderr_cut_bytes} earlier bytes of stderr cut]\n"
        parts.append("[stderr]\n" + (cut if run.stderr_cut_bytes else "") + run.stderr.rstrip("\n"))
    ending = _ending(run, limits)
    if ending:
        parts.append(f"[{ending}]")
    return "\n".join(parts) or "[no output, exit status 0]"


def _ending(run: SandboxRun, limits: SandboxLimits) -> str | None:
    """How the run ended, in words; None for a clean exit."""
    if run.timed_out:
        return f"killed: wall-clock limit {limits.timeout_s:g} s"
    if run.exit_code == -signal.SIGXCPU:
        return f"killed: CPU-time limit {limits.cpu_limit_s} s"
    if run.exit_code == -signal.SIGXFSZ:
        return f"killed: file size limit {limits.disk_mb} MB"
    if run.exit_code < 0:
        signum = -run.exit_code
        name = signal.Signals(signum).name if signum in signal.valid_signals() else signum
        return f"killed by signal {name}"
    if run.exit_code == 0:
        return None
    if run.stderr.rstrip().endswith("MemoryError"):
        return f"exit status {run.exit_code}: MemoryError, memory limit {limits.memory_mb} MB"
    return f"exit status {run.exit_code}"


python = python_tool()
