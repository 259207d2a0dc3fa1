"""Ctrl-C: a run stops promptly, says how to resume, and leaves its last checkpoint intact."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from agentgrpo.training.checkpoints import checked_checkpoint

pytestmark = pytest.mark.process

# Counter whose reset is the busy moment a test waits for: `resetting-*` exists while a reset
# sleeps SLOW_RESET_S seconds (a slow tool), `played-*` once it is done (generation follows).
SLOW_COUNTER = """
    import os
    import time
    from pathlib import Path

    from environments import Counter


    class SlowCounter(Counter):
        def reset(self, target: int) -> str:
            busy = Path.cwd() / f"resetting-{id(self)}"
            busy.touch()
            time.sleep(float(os.environ.get("SLOW_RESET_S", "0")))
            busy.unlink()
            (Path.cwd() / f"played-{id(self)}").touch()
            return super().reset(target)
"""

TRAIN_IN_PYTHON = """
    import sys
    from slow_counter import SlowCounter
    from agentgrpo import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir="out", max_steps=4, save_steps=1, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=16, chat_template="chatml_tools",
        report_to="none", disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        sys.argv[1], args=config, train_dataset=SlowCounter.dataset(),
        environment_factory=SlowCounter,
    )
    trainer.train()
"""

STOP_WITHIN_S = 60  # "does not hang": a prompt stop takes a few seconds even on a loaded machine


def start(command: list[str], cwd: Path, slow_reset_s: float) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLOW_RESET_S": str(slow_reset_s)}
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for(condition, process: subprocess.Popen) -> None:
    """Poll until `condition()` holds; fail if the process ends first."""
    while not condition():
        if process.poll() is not None:
            pytest.fail(
                f"the run ended before the moment to interrupt it:\n{process.stdout.read()}"
            )
        time.sleep(0.05)


def interrupt(process: subprocess.Popen) -> tuple[int, str]:
    """Send SIGINT (Ctrl-C) and wait, at most STOP_WITHIN_S seconds, for the process to end."""
    process.send_signal(signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"still running {STOP_WITHIN_S} s after Ctrl-C:\n{process.communicate()[0]}")
    return process.returncode, output


def resetting(cwd: Path) -> bool:
    return any(cwd.glob("resetting-*"))


def played_after(cwd: Path, checkpoint: Path):
    """True once an environment was reset after `checkpoint` was saved: generation follows."""
    state = checkpoint / "trainer_state.json"

    def condition() -> bool:
        if not state.is_file():
            return False
        return any(p.stat().st_mtime_ns > state.stat().st_mtime_ns for p in cwd.glob("played-*"))

    return condition


def assert_loads(checkpoint: Path) -> None:
    checked_checkpoint(checkpoint)
    AutoModelForCausalLM.from_pretrained(checkpoint)


def options(words: list[str]) -> dict[str, str]:
    """`--name value` pairs, in any order."""
    return dict(zip(words[::2], words[1::2], strict=True))


def interrupted_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "interrupted at step" in line]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


@pytest.mark.slow
def test_ctrl_c_stops_the_command_with_the_command_that_resumes_it(tiny_model_dir, tmp_path):
    """Ctrl-C while a reset (a slow tool) is busy, then, resumed, while generation is busy."""
    (tmp_path / "slow_counter.py").write_text(textwrap.dedent(SLOW_COUNTER))
    out = tmp_path / "out"
    command = [
        "run", "slow_counter.py:SlowCounter", "--model", str(tiny_model_dir),
        "--output-dir", str(out), "--max-steps", "4", "--save-steps", "1",
        "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "96", "--chat-template", "chatml_tools",
    ]  # fmt: skip
    run = start([sys.executable, "-m", "agentgrpo", *command], tmp_path, slow_reset_s=3)
    wait_for(lambda: (out / "checkpoint-1").is_dir() and resetting(tmp_path), run)
    status, output = interrupt(run)
    assert status == 130, output
    line = interrupted_line(output)
    assert line.startswith(
        f"interrupted at step 1; last checkpoint {out / 'checkpoint-1'}; resume with: agentgrpo "
    )
    argv = shlex.split(line.split("resume with: ")[1])
    assert argv[-1] == "--resume" and options(argv[3:-1]) == options(command[2:])
    assert_loads(out / "checkpoint-1")

    resumed = start([sys.executable, "-m", "agentgrpo", *argv[1:]], tmp_path, slow_reset_s=0)
    wait_for(played_after(tmp_path, out / "checkpoint-2"), resumed)
    status, output = interrupt(resumed)
    assert status == 130, output
    assert f"resume from  {out / 'checkpoint-1'}" in output
    assert interrupted_line(output).startswith(
        f"interrupted at step 2; last checkpoint {out / 'checkpoint-2'}; resume with: "
    )
    assert_loads(out / "checkpoint-2")


@pytest.mark.slow
def test_ctrl_c_stops_grpo_trainer_train_in_python(tiny_model_dir, tmp_path):
    """`GRPOTrainer.train()` interrupted while a reset is busy raises KeyboardInterrupt at once."""
    (tmp_path / "slow_counter.py").write_text(textwrap.dedent(SLOW_COUNTER))
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN_IN_PYTHON))
    run = start([sys.executable, "train.py", str(tiny_model_dir)], tmp_path, slow_reset_s=3)
    out = tmp_path / "out"
    wait_for(lambda: (out / "checkpoint-1").is_dir() and resetting(tmp_path), run)
    status, output = interrupt(run)
    assert status != 0 and re.search(r"^KeyboardInterrupt", output, re.MULTILINE), output
    assert_loads(out / "checkpoint-1")


STUCK_CLOSE = """
    import threading
    from pathlib import Path

    from environments import Counter


    class StuckClose(Counter):
        def close(self) -> None:
            (Path.cwd() / f"closing-{id(self)}").touch()
            threading.Event().wait()  # never returns
"""


@pytest.mark.slow
def test_a_first_ctrl_c_during_a_close_that_never_returns_stops_the_run(tiny_model_dir, tmp_path):
    (tmp_path / "stuck_close.py").write_text(textwrap.dedent(STUCK_CLOSE))
    command = [
        "run", "stuck_close.py:StuckClose", "--model", str(tiny_model_dir),
        "--output-dir", str(tmp_path / "out"), "--max-steps", "2",
        "--per-device-train-batch-size", "2", "--num-generations", "2",
        "--max-completion-length", "16", "--chat-template", "chatml_tools",
    ]  # fmt: skip
    run = start([sys.executable, "-m", "agentgrpo", *command], tmp_path, slow_reset_s=0)
    wait_for(lambda: any(tmp_path.glob("closing-*")), run)
    status, output = interrupt(run)  # before: the first Ctrl-C was ignored, the run hung
    assert status == 130, output
    assert interrupted_line(output).startswith("interrupted at step 0; no checkpoint saved yet")
    assert "left running (abandoned): StuckClose.close()" in output
