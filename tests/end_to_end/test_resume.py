"""Resume: a run killed at any moment and resumed ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import TrainerControl, TrainerState, TrainingArguments

from agentgrpo import thread_count
from agentgrpo.cli import main
from agentgrpo.reporting.run_log import MetricsLog, read_metrics
from agentgrpo.training.checkpoints import (
    checked_checkpoint,
    latest_checkpoint,
    remove_temporary,
    resume_point,
    temporary_dir,
)
from tests.support.paths import SCRIPTS
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import tiny_trainer

KILL_ON_OPEN = SCRIPTS / "kill_on_open.py"

# A reward that differs between the members of a group (so every step changes the weights) and
# opens a marker file as it scores: the moment a test can kill a run mid-step.
SCORING = """
    from pathlib import Path

    def varied(completions, trainer_state):
        open(Path.cwd() / f"scoring-after-step-{trainer_state.global_step}", "w").close()
        return [float(len(str(completion)) % 5) for completion in completions]
"""

CONSTANT = """
def constant(completions, **kwargs):
    return [1.0] * len(completions)
"""


def run_command(model_dir: Path, reward_file: Path, out: Path) -> list[str]:
    """`agentgrpo run` arguments: 5 seeded steps of the tiny model, a checkpoint every step."""
    return [
        "run", "env:Counter", "--model", str(model_dir), "--output-dir", str(out),
        "--max-steps", "5", "--save-steps", "1", "--seed", "3",
        "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "16", "--warm-start-steps", "2",
        "--chat-template", "chatml_tools", "--reward", f"{reward_file}:varied",
    ]  # fmt: skip


def start(
    arguments: list[str], cwd: Path, kill_on_open: str | None = None, threads: int = 1
) -> subprocess.Popen:
    """Start `python -m agentgrpo ARGS` with `threads` torch threads (SIGKILLed on opening
    `kill_on_open`, if given)."""
    prefix = [str(KILL_ON_OPEN), kill_on_open] if kill_on_open else ["-m", "agentgrpo"]
    return subprocess.Popen(
        [sys.executable, *prefix, *arguments],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )


def finish(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=600)
    return process.returncode, output


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def logged_steps(out: Path) -> list[int]:
    return [entry["step"] for entry in read_metrics(out / "metrics.jsonl") if "loss" in entry]


@pytest.mark.slow
@pytest.mark.process
def test_a_run_killed_during_a_save_and_mid_step_resumes_to_the_same_weights(
    tiny_model_dir, tmp_path
):
    """Killed during save 2, resumed, killed while scoring step 4, resumed: bit-for-bit equal."""
    reward_file = tmp_path / "scoring.py"
    reward_file.write_text(textwrap.dedent(SCORING))
    (tmp_path / "reference").mkdir()
    (tmp_path / "resumed").mkdir()
    reference_out, out = tmp_path / "reference" / "out", tmp_path / "resumed" / "out"
    reference = start(run_command(tiny_model_dir, reward_file, reference_out), reference_out.parent)
    command = run_command(tiny_model_dir, reward_file, out)

    # Killed halfway through saving checkpoint 2: weights written, optimizer state not.
    staged = temporary_dir(out, 2) / "checkpoint-2"
    status, output = finish(start(command, out.parent, f"{staged}/tokenizer_config.json"))
    assert status == -9, output
    assert (staged / "model.safetensors").is_file() and not (out / "checkpoint-2").exists()
    assert latest_checkpoint(out) == (out / "checkpoint-1", [])

    # Resumed from checkpoint 1, killed while scoring step 4's round (after checkpoint 3).
    status, output = finish(start([*command, "--resume"], out.parent, "*/scoring-after-step-3"))
    assert status == -9, output
    assert "resume from  " + str(out / "checkpoint-1") in output
    assert not temporary_dir(out, 2).exists()  # the killed save's leftovers are cleaned up

    # A half-written checkpoint, as saves that were not atomic left, is skipped with a warning.
    (out / "checkpoint-9").mkdir()
    (out / "checkpoint-9" / "config.json").touch()
    status, output = finish(start([*command, "--resume"], out.parent))
    assert status == 0, output
    assert "skipping incomplete checkpoint checkpoint-9 (it has no trainer_state.json)" in output
    assert "resume from  " + str(out / "checkpoint-3") in output

    status, output = finish(reference)
    assert status == 0, output
    expected, resumed = weights(reference_out / "model"), weights(out / "model")
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)
    assert logged_steps(out) == logged_steps(reference_out) == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.process
def test_a_run_killed_after_a_checkpoint_every_two_steps_resumes_to_the_same_weights(
    tiny_model_dir, tmp_path
):
    """4 steps, a checkpoint every 2, killed as step 3 scores, resumed: bit-for-bit equal.

    The run trains with 2 torch threads and its resume starts with 1: it takes back the 2 its
    checkpoint recorded (without that, its weights ended 1.2e-7 away: sums round by thread count).
    """
    reward_file = tmp_path / "scoring.py"
    reward_file.write_text(textwrap.dedent(SCORING))
    outs = {name: tmp_path / name / "out" for name in ("reference", "resumed")}
    commands = {}
    for name, out in outs.items():
        out.parent.mkdir()
        command = run_command(tiny_model_dir, reward_file, out)
        command[command.index("--max-steps") + 1] = "4"
        command[command.index("--save-steps") + 1] = "2"
        commands[name] = command
    reference = start(commands["reference"], outs["reference"].parent, threads=2)
    out = outs["resumed"]
    killed = start(commands["resumed"], out.parent, "*/scoring-after-step-2", threads=2)
    status, output = finish(killed)
    assert status == -9 and latest_checkpoint(out) == (out / "checkpoint-2", []), output
    status, output = finish(start([*commands["resumed"], "--resume"], out.parent, threads=1))
    assert status == 0, output
    assert finish(reference)[0] == 0
    expected, resumed = weights(outs["reference"] / "model"), weights(out / "model")
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)
    assert logged_steps(out) == logged_steps(outs["reference"]) == [1, 2, 3, 4]
    assert "checkpoint-2 was trained with 2 torch threads; this process had 1" in output


# ---------------------------------------------------------------------- which checkpoint


def save_checkpoint(out: Path, step: int, complete: bool = True) -> Path:
    """A checkpoint folder as the Trainer lays it out (its files' contents do not matter here)."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if complete:
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_latest_checkpoint_skips_incomplete_ones_and_says_why(tmp_path):
    save_checkpoint(tmp_path, 2)
    save_checkpoint(tmp_path, 10)
    save_checkpoint(tmp_path, 12, complete=False)
    (tmp_path / "checkpoint-11").write_text("a file")
    temporary_dir(tmp_path, 13).mkdir()
    assert latest_checkpoint(tmp_path) == (
        tmp_path / "checkpoint-10",
        ["checkpoint-12 (it has no trainer_state.json)"],
    )
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint checkpoint-12"):
        assert resume_point(True, tmp_path) == str(tmp_path / "checkpoint-10")


def test_a_trainer_state_cut_short_makes_a_checkpoint_incomplete(tmp_path):
    folder = save_checkpoint(tmp_path, 4)
    (folder / "trainer_state.json").write_text('{"global_st')
    assert latest_checkpoint(tmp_path) == (
        None,
        ["checkpoint-4 (its trainer_state.json is unreadable (cut short by a crash?))"],
    )


def test_resuming_the_latest_with_no_checkpoint_is_an_error_in_python(tmp_path):
    with pytest.raises(ValueError, match="no intact checkpoint in"):
        resume_point(True, tmp_path)
    assert resume_point(False, tmp_path) is None and resume_point(None, tmp_path) is None


def test_a_path_that_is_not_a_checkpoint_is_refused_with_the_reason(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    save_checkpoint(tmp_path, 3, complete=False)
    for path, reason in [
        (tmp_path / "missing", "no such folder"),
        (tmp_path / "notes.txt", "it is a file"),
        (tmp_path / "checkpoint-3", "it has no trainer_state.json"),
    ]:
        with pytest.raises(ValueError, match=f"cannot resume from {path}: {reason}"):
            checked_checkpoint(path)


def test_leftover_temporary_folders_are_removed(tmp_path):
    kept = save_checkpoint(tmp_path, 1)
    temporary_dir(tmp_path, 2).mkdir()
    remove_temporary(tmp_path)
    assert list(tmp_path.iterdir()) == [kept]


# ---------------------------------------------------------------------- the torch thread count


@pytest.fixture
def torch_threads():
    """The test's own torch thread count: whatever it sets is undone afterwards."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_a_resume_takes_back_the_thread_count_its_checkpoint_recorded(torch_threads, tmp_path):
    thread_count.save(tmp_path, 0, 1)
    torch.set_num_threads(torch_threads + 1)
    with pytest.warns(UserWarning, match=f"trained with {torch_threads} torch threads; this pro"):
        thread_count.restore(tmp_path, 0, 1)
    assert torch.get_num_threads() == torch_threads
    thread_count.save(tmp_path, 1, 2)
    assert (tmp_path / "torch_threads_1.json").is_file()


def test_a_checkpoint_without_a_thread_count_leaves_the_count_alone(torch_threads, tmp_path):
    torch.set_num_threads(torch_threads + 1)
    thread_count.restore(tmp_path, 0, 1)
    assert torch.get_num_threads() == torch_threads + 1


def test_a_damaged_thread_count_file_is_an_error_naming_it(torch_threads, tmp_path):
    path = tmp_path / "torch_threads.json"
    for text, says in [('{"torch_thr', "is unreadable"), ('{"torch_threads": 0}', "holds 0")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{path} {says}.*delete it to resume"):
            thread_count.restore(tmp_path, 0, 1)
    assert torch.get_num_threads() == torch_threads


# ---------------------------------------------------------------------- the command line


@pytest.fixture
def run_error(capsys, monkeypatch, tmp_path):
    """`agentgrpo run env:Counter ARGS` in-process: status 2 and one `error:` line, returned."""
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> str:
        assert main(["run", "env:Counter", *argv]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in err, err
        return errors[0]

    return run


def test_resume_from_a_path_that_is_not_a_checkpoint_is_one_clear_error(run_error, tmp_path):
    (tmp_path / "empty").mkdir()
    message = run_error("--resume-from-checkpoint", str(tmp_path / "empty"))
    assert f"cannot resume from {tmp_path / 'empty'}: it has no trainer_state.json" in message
    assert "no such folder" in run_error("--resume-from-checkpoint", "runs/x/checkpoint-9")


def test_resume_needs_the_output_folder_and_excludes_a_named_checkpoint(run_error, tmp_path):
    assert "--resume continues the run in --output-dir DIR" in run_error("--resume")
    both = run_error("--resume", "--output-dir", "out", "--resume-from-checkpoint", "out/c-1")
    assert "not both" in both


# ---------------------------------------------------------------------- metrics.jsonl


def test_metrics_log_keeps_the_history_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    lines = [json.dumps({"step": step, "loss": 0.5}) for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "lo')
    state = TrainerState(global_step=2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    log = MetricsLog()
    log.on_train_begin(args, state, TrainerControl())
    state.global_step = 3
    log.on_log(args, state, TrainerControl(), logs={"loss": 0.25})
    assert [(e["step"], e["loss"]) for e in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 0.5),
        (2, 0.5),
        (3, 0.25),
    ]


def test_a_fresh_run_starts_an_empty_metrics_log(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    MetricsLog().on_train_begin(args, TrainerState(global_step=0), TrainerControl())
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_resuming_a_finished_run_trains_nothing_and_restores_a_missing_final_model(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    reward_file = tmp_path / "scoring.py"
    reward_file.write_text(textwrap.dedent(SCORING))
    out = tmp_path / "out"
    argv = [
        "run", "env:Counter", "--model", str(tiny_model_dir), "--output-dir", str(out),
        "--max-steps", "1", "--save-steps", "1", "--per-device-train-batch-size", "2",
        "--num-generations", "2", "--max-completion-length", "8",
        "--chat-template", "chatml_tools", "--warm-start-steps", "0",
        "--reward", f"{reward_file}:varied",
    ]  # fmt: skip
    assert main(argv) == 0
    assert (out / "checkpoint-1" / "torch_threads.json").is_file()
    trained = weights(out / "model")
    untrained = weights(tiny_model_dir)
    assert any(not torch.equal(trained[name], untrained[name]) for name in trained)
    capsys.readouterr()
    (out / "model" / "model.safetensors").unlink()
    (out / "model" / "config.json").unlink()

    assert main([*argv, "--resume"]) == 0

    said = capsys.readouterr().out
    assert "reaches --max-steps 1: nothing to train" in said
    assert logged_steps(out) == [1]
    assert not (out / "checkpoint-2").exists()
    restored = weights(out / "model")
    assert all(torch.equal(restored[name], trained[name]) for name in trained)


def test_the_resume_command_keeps_the_options_as_typed_and_drops_the_resume_ones():
    from argparse import Namespace

    from agentgrpo.cli.commands import _command_line

    typed = [
        "run", "env:Counter", "--save-steps", "1", "--output-dir=old", "--reward-weights",
        "1, 0.5", "--resume-from-checkpoint", "old/checkpoint-2", "--resume",
        "--generation-kwargs", '{"min_p": 0.1}',
    ]  # fmt: skip
    assert _command_line(Namespace(argv=typed)) == [
        "agentgrpo", "run", "env:Counter", "--save-steps", "1", "--reward-weights", "1, 0.5",
        "--generation-kwargs", '{"min_p": 0.1}',
    ]  # fmt: skip


# ---------------------------------------------------------------------- what --resume continues


def test_resume_refuses_a_command_that_differs_from_the_saved_run_naming_each_difference(
    tiny_model_dir, tokenizer, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    reward_file = tmp_path / "scoring.py"
    reward_file.write_text(textwrap.dedent(SCORING))
    out = tmp_path / "out"
    options = [
        "--output-dir", str(out), "--max-steps", "1", "--save-steps", "1",
        "--per-device-train-batch-size", "2", "--num-generations", "2",
        "--max-completion-length", "8", "--chat-template", "chatml_tools",
        "--warm-start-steps", "0", "--reward", f"{reward_file}:varied",
    ]  # fmt: skip
    assert main(["run", "env:Counter", "--model", str(tiny_model_dir), *options]) == 0
    other_shape = tmp_path / "two-heads"
    tiny_llama(tokenizer, num_attention_heads=2).save_pretrained(other_shape)
    capsys.readouterr()

    def refusal(env: str, model: Path, *more: str) -> str:
        assert main(["run", env, "--model", str(model), *options, "--resume", *more]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert f"error: cannot resume {out / 'checkpoint-1'}: this command differs" in err
        return err

    assert "learning_rate 2e-05 (saved run: 1e-05)" in refusal(
        "env:Counter", tiny_model_dir, "--learning-rate", "2e-5"
    )
    assert "environment 'env:Arithmetic' (saved run: 'env:Counter')" in refusal(
        "env:Arithmetic", tiny_model_dir
    )
    assert "model num_attention_heads 2 (saved run: 4)" in refusal("env:Counter", other_shape)
    assert main(["run", "env:Counter", "--model", str(tiny_model_dir), *options, "--resume"]) == 0
    assert "nothing to train" in capsys.readouterr().out


def test_resume_with_another_reward_warns_naming_the_change_and_trains_with_it(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    scoring = tmp_path / "scoring.py"
    scoring.write_text(textwrap.dedent(SCORING) + CONSTANT)
    out = tmp_path / "out"

    def run(steps: int, reward: str, *more: str) -> str:
        options = [
            "--output-dir", str(out), "--max-steps", str(steps), "--save-steps", "1",
            "--per-device-train-batch-size", "2", "--num-generations", "2",
            "--max-completion-length", "8", "--chat-template", "chatml_tools",
            "--warm-start-steps", "0", "--reward", f"{scoring}:{reward}", *more,
        ]  # fmt: skip
        assert main(["run", "env:Counter", "--model", str(tiny_model_dir), *options]) == 0
        return capsys.readouterr().err

    run(1, "varied")
    err = run(2, "constant", "--resume")
    assert (
        f"warning: resuming {out / 'checkpoint-1'} with other rewards than the run that saved "
        f"it: reward ['{scoring}:constant'] (saved run: ['{scoring}:varied']). Training goes on "
        "with the new ones"
    ) in err
    steps = [m for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
    assert ["rewards/varied/mean" in m for m in steps] == [True, False]
    assert ["rewards/constant/mean" in m for m in steps] == [False, True]
    assert json.loads((out / "run.json").read_text())["reward"] == [f"{scoring}:constant"]
    assert "warning: resuming" not in run(3, "constant", "--resume")  # recorded: quiet


def test_resuming_in_python_with_another_architecture_names_the_difference(tokenizer, tmp_path):
    from agentgrpo import GRPOConfig

    checkpoint = save_checkpoint(tmp_path, 3)
    tiny_llama(tokenizer, num_attention_heads=2).config.to_json_file(checkpoint / "config.json")
    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_completion_length=8,
        per_device_train_batch_size=2, num_generations=2, max_steps=4,
    )  # fmt: skip
    rows = Dataset.from_dict({"prompt": ["Hi"] * 4})
    trainer = tiny_trainer(tokenizer, lambda completions, **_: [0.0] * len(completions), args, rows)
    with pytest.raises(ValueError, match=r"model num_attention_heads 4 \(saved run: 2\)"):
        trainer.train(resume_from_checkpoint=True)
