"""Chain: three dependent calculator steps, each on the last result, then ``submit``."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, ClassVar

from environments.messages import number_text, tool_turn
from environments.submission import NumberAnswer

if TYPE_CHECKING:
    import datasets

# Eval phrasings are held out: a policy must not just memorise the train wording. Eight train
# phrasings, not three: with three, the warm-started model solved almost every train row and
# GRPO's groups mostly scored alike; with eight it meets wordings it still fumbles, so groups
# disagree and held-out success rises more (docs/measurements.md).
_PHRASINGS = {
    "train": (
        "Start with {start}. Then {steps}. Use a tool for each step, then submit the result.",
        "Begin at {start}, then {steps}. Do each step with a tool and submit the final number.",
        "Take {start}. Then {steps}. Submit what you get, working out each step with a tool.",
        "Your number is {start}. Now {steps}, and submit the final value.",
        "Starting from {start}, {steps}. Call one tool per step and submit the answer.",
        "The starting value is {start}. In order: {steps}. Submit the result.",
        "Compute with the tools: {start}, then {steps}. Submit the last number.",
        "Let x be {start}. Then {steps}. Give the final x with submit.",
    ),
    "eval": (
        "From {start}: {steps}. Submit the number you end with.",
        "You have {start}. Next {steps}. One tool call per step, then submit the result.",
    ),
}
_DEMO_PHRASINGS = (
    "Example: start at {start}, then {steps}.",
    "Example: with {start}, {steps}; submit the result.",
    "Example: {start}, then {steps}. What do you get?",
)
_ROWS = {"train": 320, "eval": 64}
_STEPS = 3


class Chain(NumberAnswer):
    """Apply three operations in order, one tool call each, then ``submit`` the result.

    A row says "start with 37, then add 48, then multiply by 3, then subtract 29". The tools do
    one operation each (``add``, ``subtract``, ``multiply``), so every step's call takes the
    previous call's result: three dependent calls, then ``submit``. Reward 1.0 when the
    submitted answer equals the row's ``answer`` (within 1e-6), else 0.0, also when nothing was
    submitted. ``submit`` ends the episode; only the first submission counts. Rows have
    ``prompt``, ``start``, ``steps`` (the operations as text) and ``answer`` columns.

    Examples:
        >>> env = Chain()
        >>> env.reset(answer=226)
        >>> env.add(37, 48), env.multiply(85, 3), env.subtract(255, 29)
        ('85', '255', '226')
        >>> env.submit(226)
        'Submitted 226.'
        >>> env.done, env.reward()
        (True, 1.0)

    """

    # Four tool turns (3 steps, submit) of about 45 tokens each, tool results included.
    episode_limits: ClassVar[dict[str, int]] = {"max_completion_length": 224, "max_turns": 4}
    # With these the 135M default model learns it (docs/measurements.md): a
    # longer warm start than the run's 24 steps, a higher GRPO lr, and 4 prompts a step, not 2,
    # so fewer steps have every group scoring alike.
    run_defaults: ClassVar[dict[str, float]] = {
        "warm_start_steps": 96,
        "learning_rate": 3e-5,
        "per_device_train_batch_size": 16,
        "max_steps": 12,
    }

    def add(self, a: float, b: float) -> str:
        """Add two numbers and return the sum.

        Args:
            a: The first number.
            b: The number to add to it.

        """
        return number_text(a + b)

    def subtract(self, a: float, b: float) -> str:
        """Subtract b from a and return the difference.

        Args:
            a: The number to subtract from.
            b: The number to subtract.

        """
        return number_text(a - b)

    def multiply(self, a: float, b: float) -> str:
        """Multiply two numbers and return the product.

        Args:
            a: The first number.
            b: The number to multiply it by.

        """
        return number_text(a * b)

    def submit(self, answer: float) -> str:
        """Submit the final result; this ends the task, so call it once.

        Args:
            answer: The number the last step gave.

        Raises:
            ValueError: An answer was already submitted, or this one is not a finite number.

        """
        return self._submit(answer)

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Task rows: ``prompt`` (one user message), ``start``, ``steps`` and ``answer``.

        Each row starts from an integer from 10 to 99 and applies three operations: add or
        subtract an integer from 10 to 99, or multiply by one from 2 to 9 (at most one product);
        the same rows come back on every call.

        Args:
            split: ``"train"`` (320 rows) or ``"eval"`` (64 rows, other numbers, phrased
                differently).

        """
        if split not in _PHRASINGS:
            raise ValueError(f"Chain has splits {sorted(_PHRASINGS)}, not {split!r}")
        import datasets  # here, not at the top: importing it takes about a second

        rng = random.Random(f"chain-{split}")
        starts, steps, prompts, answers = [], [], [], []
        for _ in range(_ROWS[split]):
            start, operations = rng.randint(10, 99), _task_operations(rng)
            text = _steps_text(operations)
            starts.append(start)
            steps.append(text)
            answers.append(_apply(start, operations))
            phrasing = rng.choice(_PHRASINGS[split])
            prompts.append([{"role": "user", "content": phrasing.format(start=start, steps=text)}])
        return datasets.Dataset.from_dict(
            {"prompt": prompts, "start": starts, "steps": steps, "answer": answers}
        )

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """Conversations that show the tool-call format: a tool call per step, then ``submit``.

        Their chains are on one-digit numbers (the task's are 10 to 99), two or three steps
        long and phrased otherwise, so no demonstration answers a task row. Tool results are
        what the tools return.

        Args:
            n: How many conversations.
            seed: Picks the chains; equal seeds give equal conversations.

        Returns:
            Chat messages per conversation: a user question, a call and its result per step,
            a ``submit`` call and its result, and a final assistant message.

        """
        rng = random.Random(f"chain-demonstrations-{seed}")
        return [_demonstration(cls, rng) for _ in range(n)]


Operation = tuple[str, int]
"""A step: the tool's name and the number it applies, e.g. ``("multiply", 3)``."""

_TEXT = {"add": "add {}", "subtract": "subtract {}", "multiply": "multiply by {}"}


def _task_operations(rng: random.Random) -> list[Operation]:
    """Three steps: add or subtract 10 to 99, or multiply by 2 to 9 (at most once)."""
    operations: list[Operation] = [
        (rng.choice(("add", "subtract")), rng.randint(10, 99)) for _ in range(_STEPS)
    ]
    if rng.random() < 0.6:
        operations[rng.randrange(_STEPS)] = ("multiply", rng.randint(2, 9))
    return operations


def _steps_text(operations: list[Operation]) -> str:
    """``"add 48, then multiply by 3, then subtract 29"``."""
    return ", then ".join(_TEXT[name].format(number) for name, number in operations)


def _apply(start: int, operations: list[Operation]) -> int:
    """The value after every step."""
    value = start
    for name, number in operations:
        value = {"add": value + number, "subtract": value - number, "multiply": value * number}[
            name
        ]
    return value


def _demonstration(cls: type[Chain], rng: random.Random) -> list[dict[str, Any]]:
    """One conversation on a two- or three-step chain of one-digit numbers, with real results."""
    start = rng.randint(1, 9)
    operations = [
        (rng.choice(("add", "subtract", "multiply")), rng.randint(1, 9))
        for _ in range(rng.choice((2, _STEPS)))
    ]
    env = cls()
    env.reset(answer=_apply(start, operations))
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": rng.choice(_DEMO_PHRASINGS).format(
                start=start, steps=_steps_text(operations)
            ),
        }
    ]
    value = start
    for name, number in operations:
        result = getattr(env, name)(value, number)
        messages += tool_turn(name, {"a": value, "b": number}, result)
        value = int(result)
    messages += tool_turn("submit", {"answer": value}, env.submit(value))
    messages.append({"role": "assistant", "content": f"The result is {value}."})
    return messages
