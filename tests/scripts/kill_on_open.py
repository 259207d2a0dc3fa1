"""Run the `agentgrpo` command and SIGKILL it the moment it opens a file matching a pattern.

    python tests/scripts/kill_on_open.py PATTERN ARGS...    # as `python -m agentgrpo ARGS...`

A test's way to kill a run at an exact point, for example halfway through a checkpoint save
(`*/checkpoint-2/optimizer.pt`: the weights are written, the optimizer state is not). The
process sends SIGKILL to itself from an audit hook on `open`, so nothing after that open runs,
as when a machine loses power or the kernel kills the run for memory.
"""

from __future__ import annotations

import fnmatch
import os
import runpy
import signal
import sys


def kill_on_open(pattern: str) -> None:
    """SIGKILL this process when it opens a path matching the `fnmatch` pattern `pattern`."""

    def hook(event: str, args: tuple) -> None:
        path = args[0] if event == "open" else None
        if isinstance(path, str | bytes | os.PathLike) and fnmatch.fnmatch(
            os.fsdecode(path), pattern
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


if __name__ == "__main__":
    pattern, *arguments = sys.argv[1:]
    kill_on_open(pattern)
    sys.argv = ["agentgrpo", *arguments]
    runpy.run_module("agentgrpo", run_name="__main__", alter_sys=True)
