"""The `agentgrpo` command as tests run it and read its output."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path


def eval_figures(stdout: str) -> dict[str, str]:
    """`agentgrpo eval`'s printed figures, `episodes` and `success_rate` among them, by name."""
    return dict(line.split() for line in stdout.splitlines() if len(line.split()) == 2)


def agentgrpo(
    *args: str, cwd: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run `python -m agentgrpo ARGS` as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "agentgrpo", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def agentgrpo_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`agentgrpo ARGS` by `agentgrpo.cli.main` in this process, its output captured, as `agentgrpo`
    returns it.

    For tests of what a command does, not of its process (signals, exit, start-up): no
    interpreter starts and nothing is imported again, which saves a launch 5-10 s on 2 cores.
    """
    from agentgrpo.cli import main

    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.chdir(cwd or os.getcwd()),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            status = main(list(args))
        except SystemExit as exit_:  # argparse's usage errors
            status = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["agentgrpo", *args], status, out.getvalue(), err.getvalue())


def tiny_run(spec: str, model_dir: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    """`agentgrpo run SPEC OPTIONS` of the model in `model_dir` into `out`, in chatml_tools, in
    this process (`agentgrpo_here`)."""
    common = (
        "--model",
        str(model_dir),
        "--output-dir",
        str(out),
        "--chat-template",
        "chatml_tools",
    )
    return agentgrpo_here("run", spec, *common, *options)
