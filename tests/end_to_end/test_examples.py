"""The example scripts run as a user runs them: as subprocesses, on the tiny Llama.

Every script of `examples/` is started at once (each imports the training stack, about 10 s on
a loaded machine, so running them side by side saves most of the wait) with the smallest
settings it offers: one GRPO step, one warm-start step, one group. The checks are that it exits
0 and leaves what it promises (a saved model), not that anything was learned.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from tests.support.paths import REPO

pytestmark = pytest.mark.process

ROOT = REPO
EXAMPLES = ROOT / "examples"
# For all four together; "does not hang", not a speed check: about 170 s at a load average
# of 10 on 2 cores, where the earlier 240 s came close.
TIMEOUT_S = 900
ONE_GROUP = ("--max-steps", "1", "--batch-size", "4")  # 1 prompt x num_generations=4


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """Each example run to completion: its exit code, its output and its output folder."""
    out = tmp_path_factory.mktemp("runs")
    commands = {
        "train_counter": ("--model", tiny_model_dir, *ONE_GROUP, "--warm-start-steps", "1"),
        "plain_tools": ("--model", tiny_model_dir, *ONE_GROUP),
        "custom_rollout_func": ("--model", tiny_model_dir, *ONE_GROUP),
        "rollout_counter": ("--model", tiny_model_dir, "--rows", "1", "--generations", "2"),
    }
    # One torch thread each: four processes share the cores.
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    started = {}
    for name, arguments in commands.items():
        options = [str(a) for a in arguments]
        if name != "rollout_counter":
            options += ["--output-dir", str(out / name)]
        started[name] = subprocess.Popen(
            [sys.executable, str(EXAMPLES / f"{name}.py"), *options],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + TIMEOUT_S
    results = {}
    for name, process in started.items():
        try:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        results[name] = (process.returncode, output, out / name)
    return results


def finished(runs, name: str) -> tuple[str, Path]:
    code, output, out_dir = runs[name]
    assert code == 0, f"examples/{name}.py exited with {code}:\n{output[-4000:]}"
    return output, out_dir


@pytest.mark.parametrize("name", ["train_counter", "plain_tools", "custom_rollout_func"])
def test_a_training_example_trains_and_saves_the_model_with_its_tokenizer(runs, name):
    _, out_dir = finished(runs, name)
    assert (out_dir / "final" / "config.json").exists()
    assert (out_dir / "final" / "model.safetensors").exists()
    assert (out_dir / "final" / "tokenizer.json").exists()


def test_train_counter_warm_starts_before_grpo(runs):
    output, _ = finished(runs, "train_counter")
    assert "warm start 1/1" in output
    assert "'rewards/Counter/mean'" in output  # the environment scored the episodes


def test_rollout_counter_plays_and_prints_the_episodes(runs):
    output, _ = finished(runs, "rollout_counter")
    assert "--- group 0 episode 1" in output
    assert "2 episodes:" in output


def test_the_plain_tools_reward_reads_the_number_in_the_final_assistant_message():
    spec = importlib.util.spec_from_file_location("plain_tools", EXAMPLES / "plain_tools.py")
    plain_tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain_tools)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {}}}
    solved = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": "1647"},
        {"role": "assistant", "content": "37 * 48 - 129 is 1,647."},
    ]
    cut_off = solved[:2]  # the turn limit struck after the call: no final answer
    wrong = [{"role": "assistant", "content": "It is 1600."}]
    rewards = plain_tools.correct([solved, cut_off, wrong], answer=[1647.0] * 3)
    assert rewards == [1.0, 0.0, 0.0]
    assert plain_tools.arithmetic_questions(4).column_names == ["prompt", "answer"]


def test_the_examples_readme_gives_the_command_of_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    for script in sorted(EXAMPLES.glob("*.py")):
        commands = (f"python examples/{script.name}", f"agent:examples/{script.name}:")
        assert any(command in readme for command in commands), script.name
    assert "accelerate launch --config_file examples/accelerate/ddp.yaml" in readme


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("accelerate/*.yaml")), ids=lambda p: p.name)
def test_an_accelerate_config_parses_and_names_a_distributed_type(path):
    assert yaml.safe_load(path.read_text())["distributed_type"] in DistributedType.__members__
    assert load_config_from_file(str(path)).num_processes >= 1  # accelerate's own reading
