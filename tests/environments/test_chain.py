"""The Chain built-in: dependent tool steps, reward, task rows, demonstrations, one real episode."""

from __future__ import annotations

import itertools
import re

import anyio
import pytest

from environments import Chain, check_environment, resolve_environment, tool_names
from environments.contract import episode_limits
from rollout import Finish
from tests.support.episodes import chatml_engine, replay, scripted_backend, tool_call

_STEP = re.compile(r"(add|subtract|multiply by) (\d+)")


def started(answer: float = 226) -> Chain:
    env = Chain()
    env.reset(answer=answer)
    return env


def steps_of(row: dict) -> list[tuple[str, int]]:
    """The row's operations as (tool name, number), read back from its text."""
    return [(name.split()[0], int(number)) for name, number in _STEP.findall(row["steps"])]


def test_each_tool_does_one_operation_and_the_right_submission_scores_one():
    env = started(226)
    assert (env.add(37, 48), env.multiply(85, 3), env.subtract(255, 29)) == ("85", "255", "226")
    assert not env.done
    assert env.submit(226) == "Submitted 226."
    assert env.done and env.reward() == 1.0


def test_a_wrong_or_missing_submission_scores_zero():
    env = started(226)
    env.add(37, 48)
    assert not env.done and env.reward() == 0.0
    env.submit(85)
    assert env.done and env.reward() == 0.0


def test_only_the_first_submission_counts_and_an_infinite_one_is_refused():
    env = started(5)
    with pytest.raises(ValueError, match="finite number"):
        env.submit(float("inf"))
    env.submit(5)
    with pytest.raises(ValueError, match="already submitted"):
        env.submit(6)
    assert env.reward() == 1.0


def test_chain_meets_the_contract_and_is_a_builtin():
    check_environment(Chain)
    assert tool_names(Chain) == ["add", "multiply", "submit", "subtract"]
    assert resolve_environment("env:Chain") is Chain
    assert episode_limits(Chain) == {"max_completion_length": 224, "max_turns": 4}


# Task rows


def test_every_row_needs_three_dependent_steps_and_its_answer_is_their_result():
    for split in ("train", "eval"):
        for row in Chain.dataset(split):
            steps = steps_of(row)
            assert len(steps) == 3
            assert sum(name == "multiply" for name, _ in steps) <= 1
            env, value = started(row["answer"]), row["start"]
            for name, number in steps:  # each call takes the last call's result
                value = int(getattr(env, name)(value, number))
            assert value == row["answer"]
            assert str(row["start"]) in row["prompt"][0]["content"]
            assert row["steps"] in row["prompt"][0]["content"]


def test_eval_rows_are_held_out_by_numbers_and_phrasing():
    def phrasings(split):
        return {
            r["prompt"][0]["content"].replace(r["steps"], "{}").replace(str(r["start"]), "{}", 1)
            for r in Chain.dataset(split)
        }

    train, evaluation = Chain.dataset("train"), Chain.dataset("eval")
    assert (len(train), len(evaluation)) == (320, 64)
    keys = {(r["start"], r["steps"]) for r in train}
    assert not keys & {(r["start"], r["steps"]) for r in evaluation}
    assert len(phrasings("train")) == 8 and len(phrasings("eval")) == 2
    assert not phrasings("train") & phrasings("eval")
    assert train.to_list() == Chain.dataset("train").to_list()
    with pytest.raises(ValueError, match="splits"):
        Chain.dataset("test")


# Demonstrations


def test_demonstrations_replay_on_the_real_tools_and_reach_reward_one():
    for conversation in Chain.demonstrations(16, seed=2):
        calls = [m["tool_calls"][0]["function"] for m in conversation if m.get("tool_calls")]
        env = started(calls[-1]["arguments"]["answer"])
        assert replay(env, conversation) == [
            m["content"] for m in conversation if m["role"] == "tool"
        ]
        assert env.done and env.reward() == 1.0
        for earlier, later in itertools.pairwise(calls):  # results feed the next
            value = later["arguments"]["a" if later["name"] != "submit" else "answer"]
            assert value == int(getattr(started(), earlier["name"])(**earlier["arguments"]))


def test_demonstrations_teach_the_format_on_one_digit_chains_not_the_task_rows():
    conversations = Chain.demonstrations(64)
    rows = [*Chain.dataset("train"), *Chain.dataset("eval")]
    for conversation in conversations:
        steps = [m for m in conversation if m.get("tool_calls")][:-1]
        assert 2 <= len(steps) <= 3
        assert all(0 < int(n) < 10 for n in re.findall(r"\d+", conversation[0]["content"]))
    assert not {c[0]["content"] for c in conversations} & {r["prompt"][0]["content"] for r in rows}
    assert Chain.demonstrations(4, seed=7) == Chain.demonstrations(4, seed=7)
    assert Chain.demonstrations(4, seed=7) != Chain.demonstrations(4, seed=8)


# One episode through the real rollout engine


def test_an_episode_of_three_steps_and_a_submission_reaches_reward_one(tokenizer):
    row = Chain.dataset("eval")[0]
    turns, value = [], row["start"]
    for name, number in steps_of(row):
        turns.append(tool_call(name, a=value, b=number))
        value = int(getattr(started(), name)(value, number))
    turns += [tool_call("submit", answer=value), "never sampled: submit ends the episode"]
    backend = scripted_backend(tokenizer, turns)
    engine = chatml_engine(backend, tokenizer, Chain, **episode_limits(Chain))
    [episode] = anyio.run(engine.run, [row])
    assert episode.finish is Finish.ENV_DONE and episode.env_reward == 1.0
    assert (episode.stats.tool_calls, episode.stats.tool_failures) == (4, 0)
