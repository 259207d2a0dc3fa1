"""Train with plain tool functions and your own reward function: no environment class.

Run:

    python examples/plain_tools.py [--model PATH] [--max-steps 8] [--output-dir runs/plain_tools]

The model answers arithmetic questions and may call two tools: the built-in `calculator`, and
`percent_of`, defined below. A tool is any typed function with a Google-style docstring: the
schema the model reads comes from the signature and the docstring. Tools are stateless here, so
the task rows come from a dataset built in this script, and the score from `correct`, which
reads the model's final answer.

SmolLM2 never calls a tool zero-shot, and plain tools have no `demonstrations()` to warm-start
on: start from a model that already writes tool calls (for example `--model runs/counter/final`
after `train_counter.py`) to give GRPO episodes that differ.
"""

from __future__ import annotations

import argparse
import math
import random
import re

import torch
from datasets import Dataset

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.models.default_model import default_model_path
from tools import calculator


def percent_of(percent: float, value: float) -> float:
    """Compute a percentage of a value, e.g. 15 percent of 80 is 12.

    Args:
        percent: The percentage, e.g. 15 for 15%.
        value: The value to take the percentage of.
    """
    return percent * value / 100


def arithmetic_questions(n: int, seed: int = 0) -> Dataset:
    """`n` rows: `prompt` (one user message) and `answer` (the number that is right)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        if rng.random() < 0.5:
            question, answer = f"What is {a} * {b} - {c}?", a * b - c
        else:
            question, answer = f"What is {c * 5}% of {a * 10}?", percent_of(c * 5, a * 10)
        prompt = [{"role": "user", "content": f"{question} Use the tools, then give the number."}]
        rows.append({"prompt": prompt, "answer": float(answer)})
    return Dataset.from_list(rows)


def correct(completions: list[list[dict]], answer: list[float], **kwargs) -> list[float]:
    """1.0 when the last number of the final assistant message equals the row's answer.

    With tools, each completion is the list of messages after the prompt: assistant turns
    (some with `tool_calls`) and the `tool` messages that answered them. `answer` is the
    dataset column of that name, one value per completion.
    """
    rewards = []
    for messages, expected in zip(completions, answer, strict=True):
        final = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        numbers = re.findall(r"-?\d+(?:\.\d+)?", (final or "").replace(",", ""))
        right = bool(numbers) and math.isclose(float(numbers[-1]), expected, abs_tol=1e-6)
        rewards.append(1.0 if right else 0.0)
    return rewards


def main(cli: argparse.Namespace) -> None:
    args = GRPOConfig(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        per_device_train_batch_size=cli.batch_size,
        num_generations=4,
        learning_rate=5e-5,
        lr_scheduler_type="constant",
        max_completion_length=96,  # tokens per episode, tool responses included
        max_turns=3,  # e.g. call a tool, call another, answer
        gradient_checkpointing=False,
        chat_template="chatml_tools",  # SmolLM2's own template has no tool support
        report_to="none",
        logging_steps=1,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = GRPOTrainer(
        model=cli.model or str(default_model_path()),
        reward_funcs=correct,
        args=args,
        train_dataset=arithmetic_questions(200),
        tools=[calculator, percent_of],
    )
    trainer.train()
    trainer.save_model(f"{cli.output_dir}/final")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder (default: the embedded SmolLM2)")
    parser.add_argument("--max-steps", type=int, default=8, help="GRPO optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="a multiple of 4 (the group)")
    parser.add_argument("--output-dir", default="runs/plain_tools")
    main(parser.parse_args())
