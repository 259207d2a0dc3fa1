"""`rg:TASK`: reasoning-gym's generated questions as rows, its own scorer as the reward."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest

from environments import (
    EnvironmentSpecError,
    check_environment,
    environment_tools,
    resolve_environment,
)
from rollout import EpisodeConfig, Finish, RolloutEngine
from tests.support.episodes import scripted_backend, tool_call
from tools import call_tool

reasoning_gym = pytest.importorskip("reasoning_gym")

TASKS = ("basic_arithmetic", "leg_counting")


def started(cls: type, row: dict):
    env = cls()
    env.reset(
        question=row["question"],
        rg_seed=row["rg_seed"],
        rg_size=row["rg_size"],
        rg_index=row["rg_index"],
    )
    return env


def call(env: object, name: str, **arguments):
    """Call a tool the way the engine does: arguments checked against the schema."""
    return anyio.run(call_tool, environment_tools(env), name, arguments, None)


@pytest.mark.parametrize("task", TASKS)
def test_a_task_resolves_to_one_class_that_meets_the_contract(task):
    cls = resolve_environment(f"rg:{task}")
    check_environment(cls)
    assert cls is resolve_environment(f"rg:{task}")
    assert cls.task == task and list(environment_tools(cls())) == ["submit"]


@pytest.mark.parametrize("task", TASKS)
def test_rows_are_reasoning_gyms_questions_deterministic_and_eval_is_held_out(task):
    cls = resolve_environment(f"rg:{task}")
    train, evaluation = cls.dataset("train"), cls.dataset("eval")
    assert (len(train), len(evaluation)) == (256, 64)
    assert train.to_list() == cls.dataset("train").to_list()
    assert not set(train["question"]) & set(evaluation["question"])
    expected = reasoning_gym.create_dataset(task, size=256, seed=0)[3]
    assert train[3]["question"] == expected["question"]
    assert train[3]["answer"] == str(expected["answer"])
    assert train[3]["prompt"][0]["content"].startswith(expected["question"].strip())
    assert len(cls.dataset("eval", size=5)) == 5


def test_the_reward_is_reasoning_gyms_own_score():
    cls = resolve_environment("rg:leg_counting")
    row = cls.dataset("eval")[0]
    scorer = reasoning_gym.create_dataset("leg_counting", size=1, seed=0)
    entry = started(cls, row).entry
    for answer, score in ((row["answer"], 1.0), ("7", 0.0)):
        env = started(cls, row)
        assert call(env, "submit", answer=answer).content == "Submitted."
        assert env.done and env.reward() == scorer.score_answer(answer, entry) == score


def test_a_number_is_submitted_as_its_text_and_only_the_first_submission_counts():
    cls = resolve_environment("rg:leg_counting")
    row = cls.dataset("eval")[1]
    env = started(cls, row)
    call(env, "submit", answer=int(row["answer"]))
    assert call(env, "submit", answer="0").error is not None
    assert env.submitted == row["answer"] and env.reward() == 1.0


def test_no_submission_scores_zero():
    cls = resolve_environment("rg:basic_arithmetic")
    assert started(cls, cls.dataset("eval")[0]).reward() == 0.0


def test_demonstrations_show_the_format_on_questions_of_no_row():
    cls = resolve_environment("rg:basic_arithmetic")
    conversations = cls.demonstrations(3, seed=1)
    assert conversations == cls.demonstrations(3, seed=1)
    rows = {r["prompt"][0]["content"] for s in ("train", "eval") for r in cls.dataset(s)}
    for conversation in conversations:
        assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant"]
        assert conversation[0]["content"] not in rows
        assert conversation[2]["content"] == "Submitted."


def test_an_unknown_task_names_the_closest_ones():
    with pytest.raises(EnvironmentSpecError, match="did you mean rg:leg_counting"):
        resolve_environment("rg:leg_countin")


def test_an_episode_submitting_the_right_answer_scores_one(tokenizer):
    cls = resolve_environment("rg:basic_arithmetic")
    row = cls.dataset("eval")[0]
    engine = RolloutEngine(
        scripted_backend(tokenizer, [tool_call("submit", answer=row["answer"]), "never"]),
        tokenizer,
        environment_factory=cls,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=256, max_turns=2),
    )
    [episode] = anyio.run(engine.run, [row])
    assert episode.finish is Finish.ENV_DONE and episode.env_reward == 1.0


@pytest.mark.process
def test_envs_lists_the_tasks():
    result = subprocess.run(
        [sys.executable, "-m", "agentgrpo", "envs"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "rg:TASK" in result.stdout and "leg_counting," in result.stdout


@pytest.mark.slow
def test_run_and_eval_a_task_on_the_tiny_model(tiny_model_dir, tmp_path):
    from tests.support.cli import agentgrpo_here, tiny_run

    result = tiny_run(
        "rg:basic_arithmetic", tiny_model_dir, tmp_path / "out", "--max-steps", "1",
        "--dataset-size", "8", "--per-device-train-batch-size", "2", "--num-generations", "2",
        "--max-completion-length", "16",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rg:basic_arithmetic (8 rows)" in result.stdout
    result = agentgrpo_here(
        "eval", "rg:basic_arithmetic", "--model", str(tiny_model_dir), "--dataset-size", "2",
        "--max-completion-length", "16", "--chat-template", "chatml_tools",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "episodes" in result.stdout
