"""The Arithmetic built-in: tools, reward, task rows, demonstrations, and one real episode."""

from __future__ import annotations

import re

import anyio
import pytest

from environments import (
    Arithmetic,
    check_environment,
    environment_tools,
    resolve_environment,
    tool_names,
)
from rollout import Finish
from tests.support.episodes import (
    assert_demonstrations_train_every_call,
    chatml_engine,
    replay,
    scripted_backend,
    tool_call,
)
from tools import ToolErrorKind, calculator, call_tool


def started(answer: float = 1647) -> Arithmetic:
    env = Arithmetic()
    env.reset(answer=answer)
    return env


def call(env: object, name: str, **arguments):
    """Call a tool the way the engine does: arguments checked against the schema."""
    return anyio.run(call_tool, environment_tools(env), name, arguments, None)


def test_the_right_answer_scores_one_and_ends_the_episode():
    env = started(1647)
    assert env.calculate("37 * 48 - 129") == "1647"
    assert not env.done
    assert env.submit(1647) == "Submitted 1647."
    assert env.done and env.reward() == 1.0


def test_a_wrong_answer_scores_zero_and_also_ends_the_episode():
    env = started(1647)
    env.submit(1646)
    assert env.done and env.reward() == 0.0


def test_no_submission_scores_zero():
    env = started(1647)
    env.calculate("37 * 48 - 129")
    assert not env.done and env.reward() == 0.0


def test_answers_are_compared_as_numbers_within_a_millionth():
    env = started(1647)
    env.submit(1647.0000001)
    assert env.reward() == 1.0
    env = started(0.75)
    env.submit(0.7500000001)
    assert env.reward() == 1.0
    env = started(0.75)
    env.submit(0.7501)
    assert env.reward() == 0.0


def test_only_the_first_submission_counts():
    env = started(5)
    env.submit(5)
    result = call(env, "submit", answer=6)
    assert result.error is ToolErrorKind.EXCEPTION
    assert "already submitted" in result.content
    assert env.reward() == 1.0


def test_a_bad_expression_is_an_error_message_for_the_model_not_a_crash():
    env = started()
    for expression, message in [
        ("37 *", "not a valid arithmetic expression"),
        ("__import__('os')", "function calls are not allowed"),
        ("1 / 0", "division by zero"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            env.calculate(expression)
        result = call(env, "calculate", expression=expression)
        assert result.error is ToolErrorKind.EXCEPTION
        assert result.content.startswith("Error: calculate() raised ValueError: ")
        assert message in result.content
    assert not env.done


def test_arguments_of_the_wrong_type_are_refused_before_the_call():
    env = started()
    result = call(env, "submit", answer="1647")
    assert result.error is ToolErrorKind.BAD_ARGUMENTS
    assert env.submitted is None and not env.done


def test_reset_starts_over():
    env = started(3)
    env.submit(3)
    env.reset(answer=4)
    assert (env.done, env.submitted, env.reward()) == (False, None, 0.0)


def test_arithmetic_meets_the_contract_and_is_a_builtin():
    check_environment(Arithmetic)
    assert tool_names(Arithmetic) == ["calculate", "submit"]
    assert resolve_environment("env:Arithmetic") is Arithmetic
    assert Arithmetic.__doc__.splitlines()[0].endswith(".")


# Task rows


def test_dataset_rows_have_prompt_expression_and_the_calculators_answer():
    rows = Arithmetic.dataset("train")
    assert len(rows) == 320 and len(Arithmetic.dataset("eval")) == 64
    assert set(rows.column_names) == {"prompt", "expression", "answer"}
    for row in rows:
        [message] = row["prompt"]
        assert message["role"] == "user" and row["expression"] in message["content"]
        assert row["answer"] == int(calculator(row["expression"]))


def test_expressions_have_two_or_three_operations_on_two_or_three_digit_integers():
    for expression in Arithmetic.dataset("train")["expression"]:
        numbers = re.findall(r"\d+", expression)
        assert 3 <= len(numbers) <= 4
        assert all(10 <= int(n) <= 999 for n in numbers)
        assert expression.count("*") <= 1


def test_dataset_is_deterministic():
    assert Arithmetic.dataset("train").to_list() == Arithmetic.dataset("train").to_list()


def test_eval_split_is_held_out_by_expression_and_phrasing():
    def phrasings(split):
        return {
            row["prompt"][0]["content"].replace(row["expression"], "{}")
            for row in Arithmetic.dataset(split)
        }

    train, evaluation = Arithmetic.dataset("train"), Arithmetic.dataset("eval")
    assert not set(train["expression"]) & set(evaluation["expression"])
    assert len(phrasings("train")) == 4 and len(phrasings("eval")) == 2
    assert not phrasings("train") & phrasings("eval")


def test_dataset_refuses_an_unknown_split():
    with pytest.raises(ValueError, match="splits"):
        Arithmetic.dataset("test")


# Demonstrations


def test_demonstrations_are_well_formed_conversations():
    conversations = Arithmetic.demonstrations(8, seed=3)
    assert len(conversations) == 8
    for conversation in conversations:
        roles = [m["role"] for m in conversation]
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        calls = [m["tool_calls"][0]["function"] for m in conversation if m.get("tool_calls")]
        assert [c["name"] for c in calls] == ["calculate", "submit"]
        assert [m["name"] for m in conversation if m["role"] == "tool"] == ["calculate", "submit"]
        assert conversation[-1]["content"] and "tool_calls" not in conversation[-1]


def test_demonstration_tool_results_are_what_the_tools_return():
    for conversation in Arithmetic.demonstrations(16, seed=1):
        submitted = conversation[3]["tool_calls"][0]["function"]["arguments"]["answer"]
        env = started(submitted)
        assert replay(env, conversation) == [
            m["content"] for m in conversation if m["role"] == "tool"
        ]
        assert env.done and env.reward() == 1.0


def test_demonstrations_teach_the_format_not_the_task_rows():
    expressions = {
        c[1]["tool_calls"][0]["function"]["arguments"]["expression"]
        for c in Arithmetic.demonstrations(64)
    }
    rows = set(Arithmetic.dataset("train")["expression"]) | set(
        Arithmetic.dataset("eval")["expression"]
    )
    assert not expressions & rows
    assert all(re.fullmatch(r"\d [-+*/] \d", e) for e in expressions)  # another shape
    prompts = {c[0]["content"] for c in Arithmetic.demonstrations(64)}
    assert not prompts & {r[0]["content"] for r in Arithmetic.dataset("train")["prompt"]}


def test_demonstrations_depend_only_on_n_and_seed():
    assert Arithmetic.demonstrations(4, seed=7) == Arithmetic.demonstrations(4, seed=7)
    assert Arithmetic.demonstrations(4, seed=7) != Arithmetic.demonstrations(4, seed=8)
    assert Arithmetic.demonstrations(0) == []


# One episode through the real rollout engine


def test_an_episode_calculates_submits_and_ends_with_reward_one(tokenizer):
    row = Arithmetic.dataset("eval")[0]
    turns = [
        tool_call("calculate", expression=row["expression"]),
        tool_call("submit", answer=row["answer"]),
        "never sampled: submit ends the episode",
    ]
    backend = scripted_backend(tokenizer, turns)
    engine = chatml_engine(backend, tokenizer, Arithmetic, max_completion_length=512, max_turns=5)
    [episode] = anyio.run(engine.run, [row])
    assert episode.finish is Finish.ENV_DONE
    assert episode.env_reward == 1.0
    tool_messages = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert tool_messages == [str(row["answer"]), f"Submitted {row['answer']}."]
    assert (episode.stats.tool_calls, episode.stats.tool_failures) == (2, 0)


def test_demonstrations_lay_out_with_the_engines_template_for_the_warm_start(tokenizer):
    assert_demonstrations_train_every_call(tokenizer, Arithmetic)


def test_of_two_submissions_in_one_turn_exactly_one_counts():
    env = started(5)
    results = []

    async def two_submissions():
        async def submit(answer):
            results.append(
                await call_tool(environment_tools(env), "submit", {"answer": answer}, None)
            )

        async with anyio.create_task_group() as group:
            group.start_soon(submit, 5)
            group.start_soon(submit, 6)

    anyio.run(two_submissions)
    assert sorted(r.error is None for r in results) == [False, True]
    assert env.submitted in (5.0, 6.0) and env.done
