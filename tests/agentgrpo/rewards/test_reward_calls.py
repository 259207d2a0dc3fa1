"""Tests for agentgrpo/rewards/calls.py: TRL's calling convention, concurrency, loud errors."""

from __future__ import annotations

import functools
import math
import threading

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest
import torch

from agentgrpo.rewards.calls import (
    TRAINER_ARGUMENTS,
    RewardBatch,
    RewardFunction,
    RewardFunctionError,
    check_arguments,
    reward_functions,
    score,
)
from tests.support.tiny_model import tiny_reward_model

ROWS = [
    {"prompt": "1 + 1?", "answer": "2", "level": 1},
    {"prompt": "2 + 2?", "answer": "4", "level": 1},
    {"prompt": "3 + 3?", "answer": "6", "level": 2},
    {"prompt": "4 + 4?", "answer": "8", "level": 2},
]
COMPLETIONS = ["2", "5", "6", "eight"]


def make_batch(**changes) -> RewardBatch:
    fields = {
        "prompts": [row["prompt"] for row in ROWS],
        "completions": COMPLETIONS,
        "completion_ids": [[1, 2], [3], [4, 5, 6], [7]],
        "rows": ROWS,
    }
    return RewardBatch(**(fields | changes))


def run_score(funcs, batch=None) -> torch.Tensor:
    return anyio.run(score, reward_functions(funcs), batch or make_batch())


def correct(completions, answer):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


# --- which arguments a function receives --------------------------------------------------


def test_a_function_receives_only_the_arguments_it_names():
    seen = {}

    def named(completions, answer, completion_ids):
        seen.update(completions=completions, answer=answer, completion_ids=completion_ids)
        return [0.0] * len(completions)

    run_score([named])
    assert seen == {
        "completions": COMPLETIONS,
        "answer": ["2", "4", "6", "8"],
        "completion_ids": [[1, 2], [3], [4, 5, 6], [7]],
    }


def test_a_function_with_kwargs_receives_every_column_but_prompt_and_the_trainer_arguments():
    seen = {}

    def trl_style(completions, **kwargs):
        seen.update(kwargs)
        return [1.0] * len(completions)

    state = object()
    run_score([trl_style], make_batch(trainer_state=state))
    assert set(seen) == {"prompts", "completion_ids", "completions_ids", "answer", "level"} | {
        "trainer_state",
        "log_extra",
        "log_metric",
    }
    assert seen["level"] == [1, 1, 2, 2]
    assert seen["trainer_state"] is state
    assert "prompt" not in seen and "environments" not in seen


def test_completion_columns_reach_no_function_and_the_trainers_arguments_win_as_in_trl():
    # trl-lib/tldr has a `completion` column (the reference summary); TRL 1.16 passes neither it
    # nor a `completion_ids` column, and its own trainer_state and log_* replace same-named ones.
    rows = [
        row | {"completion": "ref", "completion_ids": [0], "trainer_state": "col", "log_metric": 1}
        for row in ROWS
    ]
    seen = {}

    def trl_style(completions, **kwargs):
        seen.update(kwargs)
        return [1.0] * len(completions)

    state = object()
    run_score([trl_style], make_batch(rows=rows, trainer_state=state))
    assert "completion" not in seen and seen["completion_ids"] == [[1, 2], [3], [4, 5, 6], [7]]
    assert seen["trainer_state"] is state and callable(seen["log_metric"])


@pytest.mark.parametrize("column", ["prompts", "completions"])
def test_a_column_named_like_the_prompts_or_completions_is_refused_naming_it(column):
    with pytest.raises(ValueError, match=rf"dataset columns \['{column}'\] have the names"):
        make_batch(rows=[row | {column: "x"} for row in ROWS])


def test_completions_ids_as_trl_documents_it_is_an_alias_of_completion_ids():
    # TRL's docs (custom reward function, Example 1) name it `completions_ids`.
    def reward_func(completions_ids, **kwargs):
        assert kwargs["completion_ids"] == completions_ids
        return [float(len(ids)) for ids in completions_ids]

    def named_only(completions_ids):
        return [float(sum(ids)) for ids in completions_ids]

    rewards_N_F = run_score([reward_func, named_only])
    assert rewards_N_F[:, 0].tolist() == [2.0, 1.0, 3.0, 1.0]
    assert rewards_N_F[:, 1].tolist() == [3.0, 3.0, 15.0, 7.0]
    check_arguments(reward_functions([named_only]), TRAINER_ARGUMENTS)


def test_environments_are_passed_when_the_batch_has_them():
    envs = [object() for _ in ROWS]
    seen = {}

    def by_env(environments):
        seen["environments"] = environments
        return [0.0] * len(environments)

    run_score([by_env], make_batch(environments=envs))
    assert seen["environments"] == envs


def test_a_parameter_that_is_not_available_is_a_user_error_naming_it():
    def typo(completions, answers):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"'typo' has a parameter 'answers'.*answer, level"):
        run_score([typo])


def test_a_positional_only_parameter_is_a_user_error():
    def positional(completions, /):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="'completions' that is positional-only"):
        run_score([positional])


def test_an_unavailable_parameter_with_a_default_keeps_its_default():
    def with_default(completions, hint="none"):
        return [float(hint == "none")] * len(completions)

    assert run_score([with_default])[:, 0].tolist() == [1.0] * 4


def test_check_arguments_fails_before_any_batch_exists():
    check_arguments(reward_functions([correct]), [*TRAINER_ARGUMENTS, "answer"])
    with pytest.raises(ValueError, match="'answer'"):
        check_arguments(reward_functions([correct]), TRAINER_ARGUMENTS)


def test_each_function_gets_its_own_lists():
    def shuffles(completions):
        completions.reverse()
        return [0.0] * len(completions)

    rewards = run_score([shuffles, correct])
    assert rewards[:, 1].tolist() == [1.0, 0.0, 1.0, 0.0]


# --- what score returns -------------------------------------------------------------------


def test_score_returns_one_float32_column_per_function_with_nan_for_none():
    def only_level_two(completions, level):
        return [1.5 if lv == 2 else None for lv in level]

    def as_bools(completions, answer):
        return [c == a for c, a in zip(completions, answer, strict=True)]

    rewards_N_F = run_score([correct, only_level_two, as_bools])
    assert rewards_N_F.dtype == torch.float32 and rewards_N_F.shape == (4, 3)
    assert rewards_N_F[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert math.isnan(rewards_N_F[0, 1]) and math.isnan(rewards_N_F[1, 1])
    assert rewards_N_F[2:, 1].tolist() == [1.5, 1.5]
    assert rewards_N_F[:, 2].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_score_with_no_functions_is_an_empty_matrix():
    assert run_score([]).shape == (4, 0)


@pytest.mark.anyio
async def test_async_and_sync_functions_run_concurrently():
    # Each function waits until all three are running: one at a time, the first would wait
    # in vain, its barrier would break after 30 s, and scoring would fail.
    all_running = threading.Barrier(3, timeout=30)

    async def slow_async(completions):
        await anyio.to_thread.run_sync(all_running.wait)
        return [1.0] * len(completions)

    def slow_sync(completions):
        all_running.wait()
        return [2.0] * len(completions)

    def slow_sync_too(completions):
        all_running.wait()
        return [3.0] * len(completions)

    funcs = reward_functions([slow_async, slow_sync, slow_sync_too])
    rewards = await score(funcs, make_batch())
    assert rewards[0].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.anyio
async def test_an_object_with_an_async_call_is_awaited():
    class Judge:
        async def __call__(self, completions):
            await anyio.lowlevel.checkpoint()
            return [0.5] * len(completions)

    [judge] = reward_functions(Judge())
    assert judge.name == "Judge"
    assert (await score([judge], make_batch()))[:, 0].tolist() == [0.5] * 4


# --- loud errors --------------------------------------------------------------------------


def test_a_function_that_raises_names_itself_and_the_row_that_broke_it():
    def parse_int(completions):
        return [float(int(c)) for c in completions]

    with pytest.raises(RewardFunctionError) as caught:
        run_score([correct, parse_int])
    message = str(caught.value)
    assert "'parse_int' raised ValueError: invalid literal for int()" in message
    assert "completion 3 of 4" in message and "'answer': '8'" in message and "'eight'" in message
    assert isinstance(caught.value.__cause__, ValueError)


def test_finding_the_row_that_raises_does_not_log_twice():
    logged = []

    def logs_then_raises(completions, log_metric):
        log_metric("seen", len(completions))
        if "eight" in completions:
            raise KeyError("eight")
        return [0.0] * len(completions)

    batch = make_batch(log_metric=lambda name, value: logged.append((name, value)))
    with pytest.raises(RewardFunctionError, match="completion 3 of 4"):
        run_score([logs_then_raises], batch)
    assert logged == [("seen", 4)]


def test_a_function_that_only_fails_on_the_whole_batch_says_so():
    def needs_a_group(completions):
        if len(completions) < 2:
            return [0.0] * len(completions)
        raise RuntimeError("boom")

    with pytest.raises(RewardFunctionError, match="no single completion raises alone"):
        run_score([needs_a_group])


def test_the_wrong_number_of_rewards_is_an_error():
    def three(completions):
        return [1.0, 1.0, 1.0]

    with pytest.raises(
        RewardFunctionError, match="'three' returned 3 rewards, but 4 were expected"
    ):
        run_score([three])


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (torch.ones(()), "returned float; it must return a list"),  # a 0-d tensor's tolist()
        ({"a": 1.0}, "returned dict; it must return a list"),
        (None, "returned NoneType"),
    ],
)
def test_a_return_value_that_is_not_a_list_is_an_error(returned, expected):
    def odd(completions):
        return returned

    with pytest.raises(RewardFunctionError, match=expected):
        run_score([odd])


@pytest.mark.parametrize("array", [torch.tensor([1.0, 0.0, 0.5, 2.0]), np.array([1, 0, 0.5, 2])])
def test_a_one_dimensional_array_or_tensor_of_rewards_is_taken_as_trl_takes_it(array):
    def as_array(completions):
        return array

    assert run_score([as_array])[:, 0].tolist() == [1.0, 0.0, 0.5, 2.0]


@pytest.mark.parametrize(
    ("bad", "expected"),
    [(math.nan, "not finite"), (math.inf, "not finite"), ("1.0", "not a number")],
)
def test_a_nan_inf_or_string_reward_names_the_sample(bad, expected):
    def one_bad(completions):
        return [1.0, 1.0, bad, 1.0]

    with pytest.raises(RewardFunctionError) as caught:
        run_score([one_bad])
    message = str(caught.value)
    assert f"'one_bad' returned {bad!r}" in message and expected in message
    assert "completion 2 of 4" in message and "'answer': '6'" in message and "'6'" in message


def test_long_rows_and_completions_are_cut_in_error_messages():
    long = "z" * 5000

    def bad(completions):
        return [math.nan] * len(completions)

    batch = make_batch(completions=[long] * 4, rows=[row | {"answer": long} for row in ROWS])
    with pytest.raises(RewardFunctionError) as caught:
        run_score([bad], batch)
    assert len(str(caught.value)) < 600


# --- RewardBatch --------------------------------------------------------------------------


def test_a_batch_takes_every_column_but_prompt_from_its_rows():
    assert make_batch().columns == {"answer": ["2", "4", "6", "8"], "level": [1, 1, 2, 2]}


def test_a_batch_refuses_lengths_that_disagree():
    with pytest.raises(ValueError, match="completion_ids"):
        make_batch(completion_ids=[[1]])


def test_a_batch_refuses_a_column_named_like_a_trainer_argument():
    with pytest.raises(ValueError, match="completions"):
        make_batch(rows=[row | {"completions": "x"} for row in ROWS])


# --- naming -------------------------------------------------------------------------------


def test_reward_functions_are_named_and_repeated_names_get_a_suffix():
    class Scorer:
        def __call__(self, completions):
            return [0.0] * len(completions)

    funcs = reward_functions(
        [correct, correct, Scorer(), functools.partial(correct), lambda completions: []]
    )
    assert [f.name for f in funcs] == ["correct", "correct_2", "Scorer", "correct_3", "<lambda>"]
    assert reward_functions(RewardFunction("mine", correct)) == [RewardFunction("mine", correct)]


def test_reward_functions_refuse_what_cannot_be_called():
    with pytest.raises(TypeError, match="not int"):
        reward_functions([correct, 3])
    with pytest.raises(
        ValueError,
        match=r"processing classes \(2\) must match the number of reward functions \(1\)",
    ):
        reward_functions([correct], processing_classes=[None, None])


# --- reward models ------------------------------------------------------------------------


def test_a_sequence_classification_model_gives_one_float_per_completion(tokenizer):
    model = tiny_reward_model(tokenizer)
    [reward_model] = reward_functions(model, processing_classes=[tokenizer])
    assert reward_model.name == "LlamaForSequenceClassification"

    completions = ["2", "5, I think, or maybe something else entirely", "6", "eight"]
    rewards = anyio.run(score, [reward_model], make_batch(completions=completions))[:, 0]
    assert rewards.shape == (4,) and torch.isfinite(rewards).all()
    # Padding changes nothing: each completion scored alone gets the same reward.
    for row, completion, reward in zip(ROWS, completions, rewards.tolist(), strict=True):
        alone = tokenizer(row["prompt"] + completion, return_tensors="pt")
        with torch.inference_mode():
            expected = model(**alone).logits[0, 0].item()
        assert reward == pytest.approx(expected, abs=1e-5)


def test_a_reward_model_renders_conversations_with_the_chat_template(tokenizer):
    model = tiny_reward_model(tokenizer)
    [reward_model] = reward_functions([model], processing_classes=[tokenizer])
    prompts = [[{"role": "user", "content": row["prompt"]}] for row in ROWS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    batch = make_batch(prompts=prompts, completions=completions)
    rewards = anyio.run(score, [reward_model], batch)[:, 0]

    text = tokenizer.apply_chat_template(prompts[1] + completions[1], tokenize=False)
    with torch.inference_mode():
        expected = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False))
    assert rewards[1].item() == pytest.approx(expected.logits[0, 0].item(), abs=1e-5)


def test_a_reward_model_path_is_loaded_with_its_tokenizer_and_named_after_its_folder(
    tokenizer, tmp_path
):
    path = tmp_path / "tiny-reward"
    tiny_reward_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    [reward_model] = reward_functions(str(path))
    assert reward_model.name == "tiny-reward"
    assert anyio.run(score, [reward_model], make_batch()).shape == (4, 1)
