"""TRL's documented GRPO examples, run as written with only the import changed.

Each test re-types an example of TRL's GRPOTrainer guide ("Using a custom reward function" and
"Agent Training", https://huggingface.co/docs/trl/grpo_trainer) and trains it for one or two
optimizer steps on the tiny random Llama, with a small local dataset in place of the hub ones.
The random model almost never stops or calls a tool, so the checks are about the plumbing: the
step ran, each reward is logged under its function's name, and each function saw the arguments
the example relies on.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import warnings

import pytest
import torch
from datasets import Dataset

from agentgrpo import GRPOConfig, GRPOTrainer
from rollout import ToolTemplateError
from tests.support.runs import one_step
from tests.support.tiny_model import tiny_llama

MAX_COMPLETION_LENGTH = 8


def config(tmp_path, **changes) -> GRPOConfig:
    """The smallest run: one step of 4 completions (2 prompts x 2 generations), 8 tokens each."""
    fields = {"max_completion_length": MAX_COMPLETION_LENGTH, "disable_tqdm": False}  # bars on
    return GRPOConfig(**one_step(tmp_path, **(fields | changes)))


def train(tokenizer, args: GRPOConfig, **trainer_arguments) -> tuple[GRPOTrainer, dict]:
    """Train the tiny Llama as TRL's docs do; returns the trainer and the last step's log."""
    trainer = GRPOTrainer(
        model=tiny_llama(tokenizer), args=args, processing_class=tokenizer, **trainer_arguments
    )
    trainer.train()
    assert trainer.state.global_step == args.max_steps
    step_logs = [log for log in trainer.state.log_history if "reward" in log]
    assert len(step_logs) == args.max_steps  # logging_steps=1: one log per optimizer step
    return trainer, step_logs[-1]


def conversation(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --- Using a custom reward function -------------------------------------------------------


def test_example_1_rewards_longer_completions_by_token_count(tokenizer, tmp_path):
    def reward_func(completions_ids, **kwargs):
        """Longer completions (in tokens) score higher."""
        return [float(len(ids)) for ids in completions_ids]

    dataset = Dataset.from_dict({"prompt": ["The sky is", "The sun is", "Grass is", "Snow is"]})
    _, log = train(
        tokenizer, config(tmp_path, max_steps=2), reward_funcs=reward_func, train_dataset=dataset
    )
    # The reward is the completion length, so it equals the length metric of the same round.
    assert log["rewards/reward_func/mean"] == pytest.approx(log["completions/mean_length"])
    assert 1 <= log["rewards/reward_func/mean"] <= MAX_COMPLETION_LENGTH


def test_example_1_1_rewards_longer_completions_by_character_count(tokenizer, tmp_path):
    calls = []

    def reward_func(completions, **kwargs):
        """Longer completions (in characters) score higher."""
        calls.append(list(completions))
        return [float(len(completion)) for completion in completions]

    dataset = Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    trainer, log = train(
        tokenizer, config(tmp_path), reward_funcs=reward_func, train_dataset=dataset
    )
    seen = [completion for call in calls for completion in call]
    # Standard (text) prompts give text completions.
    assert len(seen) == 4 and all(isinstance(completion, str) for completion in seen)
    assert log["rewards/reward_func/mean"] == pytest.approx(sum(map(len, seen)) / 4)
    assert log["reward"] == pytest.approx(log["rewards/reward_func/mean"])
    # A group (2 completions, scored in one call) whose lengths differ has nonzero advantages;
    # one whose lengths tie, which a valid draw can give, has none. The step moves the weights
    # exactly when some group does not tie.
    groups = [call[g : g + 2] for call in calls for g in range(0, len(call), 2)]
    tied = [len(first) == len(second) for first, second in groups]
    assert log["frac_reward_zero_std"] == sum(tied) / 2
    assert math.isfinite(log["loss"]) and (log["grad_norm"] > 0.0) == (not all(tied))
    untrained = tiny_llama(tokenizer).parameters()
    changed = [
        not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), untrained, strict=True)
    ]
    assert any(changed) == (not all(tied))


def test_example_2_format_reward_on_conversational_completions(tokenizer, tmp_path):
    seen = []

    def format_reward_func(completions, **kwargs):
        """1.0 when the completion is <think>...</think><answer>...</answer>, else 0.0."""
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        contents = [completion[0]["content"] for completion in completions]
        seen.extend(completions)
        return [1.0 if re.match(pattern, content) else 0.0 for content in contents]

    dataset = Dataset.from_dict(
        {"prompt": [conversation("What color is the sky?"), conversation("Where is the sun?")]}
    )
    _, log = train(
        tokenizer, config(tmp_path), reward_funcs=format_reward_func, train_dataset=dataset
    )
    # Conversational prompts give conversational completions: the assistant's messages.
    assert len(seen) == 4
    assert all(completion[0]["role"] == "assistant" for completion in seen)
    assert log["rewards/format_reward_func/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)


def test_example_3_dataset_columns_reach_the_reward_function(tokenizer, tmp_path):
    seen = []

    def reward_func(completions, ground_truth, **kwargs):
        """1.0 when the \\boxed{} content equals the ground truth, else 0.0."""
        seen.extend(zip(kwargs["prompts"], ground_truth, strict=True))
        matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        contents = [match.group(1) if match else "" for match in matches]
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth, strict=True)]

    dataset = Dataset.from_dict(
        {
            "prompt": ["Solve 2 + 2 = ?", "Solve 3 * 3 = ?", "Solve 9 - 4 = ?", "Solve 8 / 2 = ?"],
            "ground_truth": ["4", "9", "5", "4"],
        }
    )
    _, log = train(
        tokenizer,
        config(tmp_path, num_generations=4),
        reward_funcs=reward_func,
        train_dataset=dataset,
    )
    # One prompt x 4 generations: each completion came with its own row's ground truth.
    truth = dict(zip(dataset["prompt"], dataset["ground_truth"], strict=True))
    assert len(seen) == 4 and len({prompt for prompt, _ in seen}) == 1
    assert all(truth[prompt] == answer for prompt, answer in seen)
    assert "rewards/reward_func/mean" in log


def test_example_4_multi_task_rewards_of_none_are_ignored(tokenizer, tmp_path):
    scored = {"math": [], "coding": []}  # each function's rewards on its own rows

    def check_math_solution(prompt, completion):
        return completion.strip() == prompt.split("=")[-1].strip()

    def check_code_solution(prompt, completion):
        try:
            compile(completion, "<completion>", "exec")
        except (SyntaxError, ValueError):
            return False
        return "def " in completion

    def math_reward_func(prompts, completions, task, **kwargs):
        """Math rows only: 1.0 if solved, -1.0 if not; None for other tasks."""
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task, strict=True):
            if t == "math":
                rewards.append(1.0 if check_math_solution(prompt, completion) else -1.0)
                scored["math"].append(rewards[-1])
            else:
                rewards.append(None)
        return rewards

    def coding_reward_func(prompts, completions, task, **kwargs):
        """Coding rows only: 1.0 if the code is valid, -1.0 if not; None for other tasks."""
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task, strict=True):
            if t == "coding":
                rewards.append(1.0 if check_code_solution(prompt, completion) else -1.0)
                scored["coding"].append(rewards[-1])
            else:
                rewards.append(None)
        return rewards

    # Two rows and two prompts a round: every round has one task of each kind.
    dataset = Dataset.from_dict(
        {
            "prompt": ["What is 2 + 2? Answer: =", "Write a Python function that adds two ints."],
            "task": ["math", "coding"],
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "every reward function returned None"
        _, log = train(
            tokenizer,
            config(tmp_path),
            reward_funcs=[math_reward_func, coding_reward_func],
            train_dataset=dataset,
        )
    # Each mean is over the function's own 2 rows (had None counted as 0, over all 4), and
    # each completion's reward is its own task's. The random model almost always fails both
    # tasks (-1.0 everywhere), but an empty completion does solve the math row.
    assert [len(rewards) for rewards in scored.values()] == [2, 2]
    assert log["rewards/math_reward_func/mean"] == sum(scored["math"]) / 2
    assert log["rewards/coding_reward_func/mean"] == sum(scored["coding"]) / 2
    assert log["reward"] == sum(scored["math"] + scored["coding"]) / 4


def test_example_5_an_async_reward_function_is_awaited(tokenizer, tmp_path):
    async def async_reward_func(prompts, completions, **kwargs):
        """An I/O-bound reward (an API call, say): 1.0 if 'correct' is in the completion."""
        await asyncio.sleep(0.01)
        return [1.0 if "correct" in completion else 0.0 for completion in completions]

    dataset = Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    _, log = train(
        tokenizer, config(tmp_path), reward_funcs=async_reward_func, train_dataset=dataset
    )
    assert 0.0 <= log["rewards/async_reward_func/mean"] <= 1.0


def test_several_reward_functions_sync_and_async_are_weighted(tokenizer, tmp_path):
    def reward_len(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    async def reward_words(completions, **kwargs):
        await asyncio.sleep(0.01)
        return [float(len(completion.split())) for completion in completions]

    dataset = Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    _, log = train(
        tokenizer,
        config(tmp_path, reward_weights=[0.5, 2.0]),
        reward_funcs=[reward_len, reward_words],
        train_dataset=dataset,
    )
    # The logged reward is the weighted sum of the functions' rewards.
    weighted = 0.5 * log["rewards/reward_len/mean"] + 2.0 * log["rewards/reward_words/mean"]
    assert log["reward"] == pytest.approx(weighted, rel=1e-5)


# --- Agent training -----------------------------------------------------------------------


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of a and b.

    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of a and b.

    """
    await asyncio.sleep(0.01)
    return a + b


AGENT_DATASET = {
    "prompt": [conversation("What is 3 multiplied by 4?"), conversation("What is 17 plus 25?")],
    "answer": ["12", "42"],
}


def correctness_reward(completions, answer, **kwargs):
    """1.0 when the last message of the completion contains the answer."""
    return [
        1.0 if ans in completion[-1]["content"] else 0.0
        for completion, ans in zip(completions, answer, strict=True)
    ]


def test_agent_training_with_sync_and_async_tools(tokenizer, tmp_path):
    seen = []

    def completions_are_conversations(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    _, log = train(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools"),
        reward_funcs=[correctness_reward, completions_are_conversations],
        train_dataset=Dataset.from_dict(AGENT_DATASET),
        tools=[multiply, async_add],
    )
    assert "rewards/correctness_reward/mean" in log
    assert len(seen) == 4 and all(completion[0]["role"] == "assistant" for completion in seen)
    assert {"tools/call_frequency", "tools/failure_frequency", "turns/mean"} <= log.keys()


def test_tools_with_a_template_that_cannot_show_them_name_chatml_tools(tokenizer, tmp_path):
    # SmolLM2's own chat template has no tool support.
    with pytest.raises(ToolTemplateError, match="chatml_tools"):
        GRPOTrainer(
            model=tiny_llama(tokenizer),
            reward_funcs=correctness_reward,
            args=config(tmp_path),
            train_dataset=Dataset.from_dict(AGENT_DATASET),
            processing_class=tokenizer,
            tools=[multiply, async_add],
        )


# --- Environments -------------------------------------------------------------------------


class IncrementEnv:
    """A counter to bring to a target the environment picks itself (TRL's environment example)."""

    def reset(self, **kwargs) -> str:
        self.counter = 0
        self.target = random.randint(1, 10)
        return f"Increment the counter by {self.target}."

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: The value to add to the counter.

        Returns:
            The counter after the increment.

        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return 1.0 if self.counter == self.target else 0.0


def test_an_environment_states_its_own_tasks_and_scores_itself(tokenizer, tmp_path):
    _, log = train(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools"),
        environment_factory=IncrementEnv,
    )
    # The random model never reaches the target.
    assert log["rewards/IncrementEnv/mean"] == 0.0
    assert log["reward"] == 0.0


def test_an_environment_with_dataset_prompts_and_a_reward_function(tokenizer, tmp_path):
    # The older documented form: the dataset states the task, a reward function scores it.
    class IncrementEnv:
        def reset(self) -> None:
            self.counter = 0

        def increment(self, step: int) -> int:
            """Increment the counter.

            Args:
                step: The value to add to the counter.

            Returns:
                The counter after the increment.

            """
            self.counter += step
            return self.counter

    seen = []

    def reward_func(environments, target, **kwargs):
        seen.extend(environments)
        return [float(env.counter == t) for env, t in zip(environments, target, strict=True)]

    dataset = Dataset.from_dict(
        {
            "prompt": [conversation("Increment the counter by 3."), conversation("Add 5.")],
            "target": [3, 5],
        }
    )
    _, log = train(
        tokenizer,
        config(tmp_path, chat_template="chatml_tools"),
        reward_funcs=reward_func,
        train_dataset=dataset,
        environment_factory=IncrementEnv,
    )
    # One fresh environment per completion, each reset before its episode.
    assert len({id(env) for env in seen}) == 4
    assert all(isinstance(env, IncrementEnv) and env.counter == 0 for env in seen)
    assert log["rewards/reward_func/mean"] == 0.0
