"""`tool_call_match`: the ready reward of function-calling rows, in BFCL's and xLAM's formats."""

from __future__ import annotations

import json

import pytest

from agentgrpo.rewards import tool_call_match
from tests.rollout.test_row_tools import PLAY, TRIANGLE
from tests.support.trainer import logged, short_run_config, tiny_trainer


def calls(*made: tuple[str, dict]) -> list[dict]:
    """A completion whose one assistant turn makes `made` calls."""
    tool_calls = [
        {"type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in made
    ]
    return [{"role": "assistant", "content": "", "tool_calls": tool_calls}]


AREA = [{"area": {"base": [10], "unit": ["cm", ""], "exact": [True]}}]


@pytest.mark.parametrize(
    ("arguments", "reward"),
    [
        ({"base": 10, "exact": True}, 1.0),  # "unit" may be left out: its values hold ""
        ({"base": 10.0, "unit": " CM ", "exact": True}, 1.0),  # 10 == 10.0; case, spaces
        ({"base": 10, "unit": "mm", "exact": True}, 0.0),
        ({"base": 10, "exact": 1}, 0.0),  # a number is not a bool
        ({"unit": "cm", "exact": True}, 0.0),  # "base" may not be left out
        ({"base": 10, "exact": True, "height": 3}, 0.0),  # an argument the gold call lacks
    ],
)
def test_bfcl_acceptable_values(arguments, reward):
    assert tool_call_match([calls(("area", arguments))], ground_truth=[AREA]) == [reward]


def test_parallel_calls_match_in_any_order_and_one_to_one():
    gold = [{"f": {"x": [1, 2]}}, {"f": {"x": [1]}}]
    assert tool_call_match([calls(("f", {"x": 1}), ("f", {"x": 2}))], ground_truth=[gold]) == [1.0]
    assert tool_call_match([calls(("f", {"x": 2}), ("f", {"x": 1}))], ground_truth=[gold]) == [1.0]
    assert tool_call_match([calls(("f", {"x": 2}), ("f", {"x": 2}))], ground_truth=[gold]) == [0.0]
    assert tool_call_match([calls(("f", {"x": 1}))], ground_truth=[gold]) == [0.0]


def test_nested_dicts_and_lists_compare_value_by_value():
    gold = [{"book": {"guest": [{"name": ["Ada"], "age": [36, ""]}], "nights": [[1, 2]]}}]
    right = calls(("book", {"guest": {"name": "ada"}, "nights": [1, 2.0]}))
    wrong = calls(("book", {"guest": {"name": "Ada"}, "nights": [2, 1]}))
    assert tool_call_match([right, wrong], ground_truth=[gold, gold]) == [1.0, 0.0]


def test_xlam_answers_are_exact_values_and_may_be_json_strings():
    answers = json.dumps([{"name": "search", "arguments": {"q": "tea", "limit": 5}}])
    made = [
        calls(("search", {"q": "Tea", "limit": 5})),
        calls(("search", {"q": "tea"})),
        calls(("search", json.dumps({"q": "tea", "limit": 5}))),  # type: ignore[arg-type]
    ]
    assert tool_call_match(made, answers=[answers] * 3) == [1.0, 0.0, 1.0]


def test_rows_without_gold_calls_are_not_scored_and_text_completions_are_refused():
    assert tool_call_match([calls()], ground_truth=[None]) == [None]
    with pytest.raises(ValueError, match=r"'ground_truth' column .* or an 'answers' column"):
        tool_call_match([calls()])
    with pytest.raises(ValueError, match="this one is text"):
        tool_call_match(["<tool_call>{}</tool_call>"], ground_truth=[AREA])
    with pytest.raises(ValueError, match="BFCL's format"):
        tool_call_match([calls()], ground_truth=[{"area": {}}])


def test_a_grpo_step_trains_on_bfcl_rows_scored_by_their_calls(tokenizer, tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": "Triangle, base 10 and height 5: its area?"}],
            "tools": json.dumps([TRIANGLE]),
            "ground_truth": [{"calculate_triangle_area": {"base": [10], "height": [5]}}],
            "max_turns": 1,
        },
        {
            "prompt": "Play Maroon 5 for 15 minutes.",  # a text prompt: rows with tools chat
            "tools": [PLAY],
            "ground_truth": [{"spotify.play": {"artist": ["Maroon 5"], "duration": [15]}}],
            "max_turns": 1,
        },
    ]
    args = short_run_config(
        tmp_path, max_steps=1, per_device_train_batch_size=4, num_generations=2,
        chat_template="chatml_tools",
    )  # fmt: skip
    trainer = tiny_trainer(tokenizer, tool_call_match, args, rows * 2)
    trainer.train()
    assert trainer.state.global_step == 1
    assert logged(trainer, "rewards/tool_call_match/mean") == [0.0]  # random weights: no call
