"""The `agentgrpo` command as tests run it and read its output."""

from __future__ import annotations

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


def tiny_run(spec: str, model_dir: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    """`agentgrpo run SPEC OPTIONS` of the model in `model_dir` into `out`, in chatml_tools."""
    common = (
        "--model",
        str(model_dir),
        "--output-dir",
        str(out),
        "--chat-template",
        "chatml_tools",
    )
    return agentgrpo("run", spec, *common, *options)
