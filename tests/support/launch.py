"""`accelerate launch` of `tests/scripts/distributed_train.py`, killed whole on a timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO, SCRIPTS
from tests.support.vllm_support import free_port

SCRIPT = SCRIPTS / "distributed_train.py"
CONFIGS = REPO / "examples" / "accelerate"
# "Does not hang", not a speed check: two processes each import the training stack and train,
# which takes minutes on a loaded 2-core machine.
LAUNCH_TIMEOUT_S = 900
# distributed_train.py prints every thread's stack and exits after this long: a hung launch
# ends with where each process waited, before the launch timeout kills it unheard.
STACKS_AFTER_S = LAUNCH_TIMEOUT_S - 120
# Where a process's report of an error or of its stacks starts.
REPORT_STARTS = ("Traceback (most recent call last)", "(most recent call first)")
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
# The ZeRO configs ask for bf16; the runs that compare weights launch in float32.
FLOAT32_LAUNCH = ("--mixed_precision", "no")


def accelerate_launch(
    config: Path,
    num_processes: int,
    script_args: list[str],
    env: dict,
    launch_args: tuple[str, ...] = (),
):
    """Run `accelerate launch` of the script in its own process group; (returncode, output)."""
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch"),
        *("--config_file", str(config)),
        *("--num_processes", str(num_processes)),
        *("--main_process_port", str(free_port())),
        *launch_args,
        *(str(SCRIPT), *script_args),
    ]
    return run_in_own_group(command, env)


def run_in_own_group(command: list[str], env: dict):
    """Run `command` from the repository root; kill its whole process group on a timeout."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "STACKS_AFTER_S": str(STACKS_AFTER_S), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"accelerate launch ran past {LAUNCH_TIMEOUT_S} s:\n{launch_report(output)}")
    return process.returncode, output


def launch_report(
    output: str, first: int = 3, each_chars: int = 3000, tail_chars: int = 4000
) -> str:
    """A failed launch's first tracebacks (or stack dumps), each to its error, then its last lines.

    The processes of a launch fail one after another, and the last to fail (often with an error
    that only says another process left) buries the first cause under its own output. A report
    longer than `each_chars` keeps its first and last halves: where it started, and the error.
    """
    starts = sorted(
        match.start()
        for marker in REPORT_STARTS
        for match in re.finditer(re.escape(marker), output)
    )
    firsts = [_report_at(output, start, each_chars) for start in starts[:first]]
    return "\n...\n".join([*firsts, f"last {tail_chars} characters:\n{output[-tail_chars:]}"])


def _report_at(output: str, start: int, each_chars: int) -> str:
    """The traceback starting at `start`, through its error line; its middle cut when long.

    Its frames are the indented lines after the first (each process prefixes its own lines with
    `[rankN]: `); the first line after them that is not indented is the error.
    """
    lines = output[start:].splitlines(keepends=True)
    end = len(lines)
    for number, line in enumerate(lines[1:], start=1):
        text = re.sub(r"^\[rank\d+\]: ", "", line)
        if text.strip() and not text.startswith((" ", "\t")):
            end = number + 1
            break
    report = output[max(0, start - 200) : start] + "".join(lines[:end])
    if len(report) <= each_chars:
        return report
    half = each_chars // 2
    return f"{report[:half]}\n[... {len(report) - 2 * half} characters ...]\n{report[-half:]}"
