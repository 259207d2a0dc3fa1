"""The output folder: one run at a time in it, and a folder that refuses writes said plainly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from agentgrpo.cli import main
from agentgrpo.reporting.run_log import EpisodeLog, EpisodeSamples, MetricsLog
from agentgrpo.run_folder import (
    LOCK_FILE,
    OutputDirBusy,
    OutputDirUnwritable,
    explained_write_errors,
    hold,
)
from rollout import EpisodeRecord
from tests.support.episodes import COUNTER_TURNS, scripted_episode
from tests.support.paths import REPO

ROOT = REPO
HOLDER = """
    import sys
    from agentgrpo.run_folder import hold

    with hold(sys.argv[1]):
        print("held", flush=True)
        sys.stdin.read()  # until the test closes it
"""


@pytest.fixture
def other_run():
    """Start processes that each hold a folder's lock until `release` (or the test's end)."""
    processes: list[subprocess.Popen] = []

    def start(folder: Path) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HOLDER), str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        processes.append(process)
        assert process.stdout.readline() == "held\n"
        return process

    yield start
    for process in processes:
        release(process)


def release(process: subprocess.Popen) -> None:
    process.communicate(input="", timeout=60)
    assert process.returncode == 0


@pytest.mark.process
def test_a_second_run_into_a_busy_output_folder_fails_at_once_naming_the_other_pid(
    other_run, tmp_path, capsys
):
    out = tmp_path / "out"
    holder = other_run(out)
    status = main(["run", "env:Counter", "--output-dir", str(out), "--model", "no/such-model"])
    assert status == 2
    err = capsys.readouterr().err
    assert (
        f"error: output folder {out} is in use by another agentgrpo run (pid {holder.pid})" in err
    )
    assert "Traceback" not in err


@pytest.mark.process
def test_the_lock_is_free_again_once_its_holder_exits(other_run, tmp_path):
    holder = other_run(tmp_path)
    with pytest.raises(OutputDirBusy, match=f"pid {holder.pid}"), hold(tmp_path):
        pass
    release(holder)
    with hold(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"


@pytest.mark.process
def test_one_process_may_hold_its_own_folder_twice_and_frees_it_after(other_run, tmp_path):
    with hold(tmp_path), hold(tmp_path):
        pass
    release(other_run(tmp_path))  # it could take the lock


# ---------------------------------------------------------------------- folders that refuse writes


def mount_tmpfs(folder: Path, options: str) -> None:
    """Mount a tmpfs on `folder` (skip the test where this process may not mount)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB file system (a tmpfs), unmounted after the test."""
    folder = tmp_path / "small"
    mount_tmpfs(folder, "size=1m")
    yield folder
    subprocess.run(["umount", "--lazy", str(folder)], check=True)


@pytest.fixture
def read_only(tmp_path):
    """A folder this process cannot write: a read-only tmpfs as root, else a mode-555 folder."""
    folder = tmp_path / "read-only"
    if os.geteuid() != 0:
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mount_tmpfs(folder, "ro,size=1m")
    yield folder
    subprocess.run(["umount", "--lazy", str(folder)], check=True)


@pytest.mark.process
def test_a_save_onto_a_full_disk_says_the_disk_is_full_and_names_the_folder(small_disk):
    with pytest.raises(OutputDirUnwritable) as error, explained_write_errors(small_disk):
        torch.save(torch.zeros(1 << 20), small_disk / "weights.pt")  # 4 MiB
    assert str(error.value).startswith(
        f"cannot write to output folder {small_disk}: No space left on device"
    )
    assert "free some space on its disk" in str(error.value)


@pytest.mark.process
def test_a_save_into_a_read_only_folder_says_why(read_only):
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    expected = pytest.raises(OutputDirUnwritable, match=f"{read_only}: {reason}")
    with expected, explained_write_errors(read_only):
        torch.save(torch.zeros(4), read_only / "weights.pt")
    with pytest.raises(OutputDirUnwritable, match=f"{read_only}: {reason}"), hold(read_only):
        pass


def test_a_save_failure_the_folder_did_not_cause_passes_through_unchanged(tmp_path):
    with pytest.raises(RuntimeError, match=r"^a bug$"), explained_write_errors(tmp_path):
        raise RuntimeError("a bug")  # in a folder with room: not the folder's fault


@pytest.mark.process
def test_a_run_whose_disk_fills_up_ends_with_one_error_line(
    small_disk, tiny_model_dir, capsys, monkeypatch
):
    monkeypatch.chdir(small_disk.parent)
    argv = [
        "run", "env:Counter", "--model", str(tiny_model_dir), "--output-dir", str(small_disk),
        "--max-steps", "1", "--save-steps", "1", "--per-device-train-batch-size", "2",
        "--num-generations", "2", "--max-completion-length", "8",
        "--chat-template", "chatml_tools", "--warm-start-steps", "0",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write to output folder {small_disk}: No space left on device" in err
    assert "Traceback" not in err
    assert not list(small_disk.glob("_tmp-*")), "the failed checkpoint's folder is removed"


def fill(disk: Path) -> None:
    """Write into `disk` until it is full, so the next write of any size fails."""
    with pytest.raises(OSError, match="No space left"), (disk / "filler").open("wb") as file:
        file.write(bytes(2 << 20))  # 2 MiB onto a 1 MiB file system


def callback_args(folder: Path, step: int = 1):
    args = SimpleNamespace(output_dir=str(folder), world_size=1)
    return args, TrainerState(global_step=step, max_steps=3, epoch=0.0), TrainerControl()


@pytest.mark.process
def test_a_metrics_line_onto_a_full_disk_says_the_disk_is_full_and_names_the_folder(small_disk):
    fill(small_disk)
    with pytest.raises(OutputDirUnwritable) as error:  # before: a plain OSError
        MetricsLog().on_log(*callback_args(small_disk), logs={"reward": 1.0})
    assert str(error.value).startswith(
        f"cannot write to output folder {small_disk}: No space left on device"
    )


@pytest.mark.process
def test_an_episode_file_onto_a_full_disk_says_so_and_leaves_no_temporary_file(
    small_disk, tokenizer
):
    (small_disk / "episodes").mkdir()
    fill(small_disk)
    episode = scripted_episode(tokenizer, COUNTER_TURNS)
    record = EpisodeRecord(episode, {"Counter": 1.0}, reward=1.0, advantage=0.5, policy_version=0)
    # what EpisodeLog reads of the trainer
    trainer = SimpleNamespace(last_records=[record], last_round_step=0)
    with pytest.raises(OutputDirUnwritable, match=f"{small_disk}: No space left on device"):
        EpisodeLog(trainer).on_step_end(*callback_args(small_disk))
    assert list((small_disk / "episodes").iterdir()) == []


@pytest.mark.process
def test_metrics_and_episode_samples_into_a_read_only_folder_say_why(read_only, tokenizer):
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    args, state, control = callback_args(read_only)
    with pytest.raises(OutputDirUnwritable, match=f"{read_only}: {reason}"):
        MetricsLog().on_log(args, state, control, logs={"reward": 1.0})
    trainer = SimpleNamespace(last_episodes=[(scripted_episode(tokenizer, COUNTER_TURNS), 1.0)])
    with pytest.raises(OutputDirUnwritable, match=f"{read_only}: {reason}"):
        EpisodeSamples(trainer).on_log(args, state, control, logs={"reward": 1.0})
