"""Tests for agentgrpo/rewards/builtin.py: accuracy, think format, soft overlong punishment."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agentgrpo.rewards import (
    accuracy_reward,
    answers_match,
    extract_answer,
    get_soft_overlong_punishment,
    think_format_reward,
)
from agentgrpo.rewards.math_check import MathChecker

# accuracy_reward compares answers in a child process, started by whichever test needs it first.
pytestmark = pytest.mark.process


def accuracy(completion, gold):
    [reward] = accuracy_reward([completion], solution=[gold])
    return reward


# --- accuracy_reward: equal answers ---------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5"),
        (r"\boxed{2\sqrt{3}}", r"\sqrt{12}"),
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\tfrac34", "0.75"),
        ("1,000", "1000"),
        ("x = 5", "5"),
        (r"\boxed{\sqrt[3]{8}}", "2"),
        (r"\boxed{3 \cdot 4}", r"2 \times 6"),
        (r"\boxed{\pi r^2}", r"r^{2}\pi"),
        (r"\boxed{x^2 + 2x + 1}", "(x+1)^2"),
        (r"\boxed{90^\circ}", "90"),
        (r"\boxed{50\%}", "50"),
        (r"\boxed{5 \text{ cm}}", "5"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3, \frac{\pi}{2})"),
        (r"\boxed{[1, 2)}", "[1,2)"),
        (r"\boxed{-\frac{1}{2}}", "-0.5"),
        ("<answer>42</answer>", "42"),
        ("I counted them all: 1,000 apples.", "Natalia sold 500 + 500 clips.\n#### 1000"),
        (r"The value is $\frac{7}{2}$.", r"Hence the answer is $\dfrac{7}{2}$"),
    ],
)
def test_equal_answers_score_one(completion, gold):
    assert accuracy(completion, gold) == 1.0


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        (r"\boxed{4}", "5"),
        (r"\boxed{\frac{1}{3}}", "0.33"),
        (r"\boxed{(1, 2)}", "(2, 1)"),
        (r"\boxed{[1, 2)}", "[1, 2]"),
        (r"\boxed{\sqrt{x^2}}", "x"),  # |x|, not x
        ("x - 3", "3"),
        ("I have no idea.", "7"),
    ],
)
def test_wrong_or_missing_answers_score_zero(completion, gold):
    assert accuracy(completion, gold) == 0.0


def test_a_gold_solution_without_a_readable_answer_makes_the_sample_not_applicable():
    assert accuracy_reward(["42", "42"], solution=["See the figure.", ""]) == [None, None]


def test_conversational_completions_are_scored_on_the_last_assistant_message():
    completion = [
        {"role": "assistant", "content": "Let me call a tool.", "tool_calls": []},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": r"It is \boxed{7}."},
    ]
    tool_only = [{"role": "assistant", "content": None}]
    assert accuracy_reward([completion, tool_only], solution=["7", "7"]) == [1.0, 0.0]


def test_the_last_boxed_answer_with_balanced_braces_wins():
    assert extract_answer(r"\boxed{1} then \boxed{\frac{2}{3}} then \boxed{4") == r"\frac{2}{3}"


def test_pathological_answers_are_rejected_quickly():
    accuracy_reward([r"\boxed{\sqrt{2}}"], solution=["1.41421356"])  # import sympy first
    completions = [
        r"\boxed{9^{9^{9^{9^{9}}}}}",
        r"\boxed{(10^{999})^{999}}",
        r"\boxed{1000!!}",
        r"\boxed{(x+1)^{1000} - (x-1)^{1000}}",
        r"\boxed{" + "(" * 190 + "}",
        r"\boxed{" * 100_000,
        "<answer>" * 50_000,
        r"\(" * 50_000,
        "$" * 100_000 + "1",
        "9" * 100_000,
    ]
    start_s = time.perf_counter()
    rewards = accuracy_reward(completions, solution=["1"] * len(completions))
    assert time.perf_counter() - start_s < 10.0  # not minutes: none reaches sympy's slow paths
    assert rewards == [0.0] * 8 + [1.0, 0.0]


def test_answers_never_reach_eval():
    assert not answers_match("__import__('os').system('false')", "0")


def test_a_comparison_past_its_time_limit_is_not_equal_and_the_checker_goes_on():
    checker = MathChecker(timeout_s=5.0)  # room for a loaded machine; the hang takes far longer
    try:
        assert not checker.equal("1", "10^{10^{10}}")  # sympy would build 10^10 digits
        assert checker.equal(r"\frac{1}{2}", "0.5")  # a new process answers
    finally:
        checker.close()


def test_answers_are_checked_from_many_threads_at_once():
    cases = [(r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0), (r"\boxed{\frac{1}{3}}", "0.33", 0.0)] * 4
    with ThreadPoolExecutor(max_workers=4) as pool:
        rewards = list(pool.map(lambda case: accuracy(case[0], case[1]), cases))
    assert rewards == [expected for _, _, expected in cases]


# --- think_format_reward ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("<think>2 + 2 = 4</think>The answer is 4.", 1.0),
        ("<think></think>4", 1.0),
        ("<think>\nstep\n</think>\n\n4 </think>", 1.0),
        ("The answer is 4.", 0.0),
        (" <think>late</think>4", 0.0),
        ("<think>a<think>b</think></think>4", 0.0),
        ("<think>a</think><think>b</think>4", 0.0),
        ("<think>never closed", 0.0),
        ("4 <think>after</think>", 0.0),
    ],
)
def test_think_format_rewards_one_leading_think_block(text, reward):
    assert think_format_reward([text]) == [reward]


def test_think_format_reads_conversational_completions():
    completion = [{"role": "assistant", "content": "<think>ok</think>4"}]
    assert think_format_reward([completion]) == [1.0]


# --- soft overlong punishment -------------------------------------------------------------


def test_soft_overlong_punishment_is_zero_then_linear_then_minus_one():
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    lengths = [0, 80, 81, 90, 99, 100, 101, 500]
    values = reward(completion_ids=[[1] * n for n in lengths], completions=["x"] * len(lengths))
    assert values == pytest.approx([0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0, -1.0])
    assert reward.__name__ == "soft_overlong_punishment"


def test_soft_overlong_punishment_without_a_cache_only_punishes_beyond_the_limit():
    reward = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=0)
    assert reward(completion_ids=[[1] * 10, [1] * 11]) == [0.0, -1.0]


def test_soft_overlong_punishment_rejects_a_cache_larger_than_the_limit():
    with pytest.raises(ValueError, match="soft_punish_cache"):
        get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=11)
