"""Arithmetic: a multi-step tool task, work it out with ``calculate`` and answer with ``submit``."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, ClassVar

from environments.messages import tool_turn
from environments.submission import NumberAnswer
from tools.calculator import calculator

if TYPE_CHECKING:
    import datasets

_PHRASINGS = {  # eval phrasings are held out: a policy must not just memorise the train wording
    "train": (
        "What is {expression}? Use the calculate tool, then submit the answer.",
        "Compute {expression} with the calculator and submit the result.",
        "Work out {expression}: call calculate to evaluate it, then submit it.",
        "Find the value of {expression}, then submit it.",
    ),
    "eval": (
        "Evaluate {expression} and give your answer with submit.",
        "How much is {expression}? Submit the number once you have it.",
    ),
}
_DEMO_PHRASING = "Example: what is {expression}?"
_ROWS = {"train": 320, "eval": 64}


class Arithmetic(NumberAnswer):
    """Evaluate an arithmetic expression with ``calculate``, then ``submit`` the answer.

    Reward 1.0 when the submitted answer equals the row's ``answer`` (within 1e-6), else 0.0,
    also when nothing was submitted. ``submit`` ends the episode; only the first submission
    counts. Rows have an ``answer`` column read by `reset`, an ``expression`` column (the
    question's expression, for logs and reward functions) and a ``prompt`` column.

    Examples:
        >>> env = Arithmetic()
        >>> env.reset(answer=1647)
        >>> env.calculate("37 * 48 - 129")
        '1647'
        >>> env.submit(1647)
        'Submitted 1647.'
        >>> env.done, env.reward()
        (True, 1.0)

    """

    # An episode is a calculate turn and a submit turn (the longest expressions: 180 tokens).
    episode_limits: ClassVar[dict[str, int]] = {"max_completion_length": 192, "max_turns": 3}

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return the result.

        Supports + - * / // % ** (power), unary minus, parentheses, integers and decimals.

        Args:
            expression: The arithmetic expression, e.g. "(3 + 4) * 12".

        Raises:
            ValueError: The expression is not plain arithmetic (the model reads the message).

        """
        return calculator(expression)

    def submit(self, answer: float) -> str:
        """Submit the final answer; this ends the task, so call it once.

        Args:
            answer: The value of the expression.

        Raises:
            ValueError: An answer was already submitted, or this one is not a finite number.

        """
        return self._submit(answer)

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Task rows: ``prompt`` (one user message), ``expression`` and ``answer`` (an int).

        Each expression has 2 or 3 of ``+ - *`` (at most one ``*``) on integers from 10 to 999,
        sometimes with parentheses; the same rows come back on every call.

        Args:
            split: ``"train"`` (320 rows) or ``"eval"`` (64 rows, other expressions, phrased
                differently).

        """
        if split not in _PHRASINGS:
            raise ValueError(f"Arithmetic has splits {sorted(_PHRASINGS)}, not {split!r}")
        import datasets  # here, not at the top: importing it takes about a second

        rng = random.Random(f"arithmetic-{split}")
        expressions = [_task_expression(rng) for _ in range(_ROWS[split])]
        prompts = [
            [{"role": "user", "content": rng.choice(_PHRASINGS[split]).format(expression=e)}]
            for e in expressions
        ]
        answers = [int(calculator(e)) for e in expressions]
        return datasets.Dataset.from_dict(
            {"prompt": prompts, "expression": expressions, "answer": answers}
        )

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """Conversations that show the tool-call format: ``calculate``, then ``submit``.

        Their expressions have another shape than the task's (one operation, ``/`` included,
        on one-digit numbers), so no demonstration answers a task row. Tool results are what
        the tools return.

        Args:
            n: How many conversations.
            seed: Picks the expressions; equal seeds give equal conversations.

        Returns:
            Chat messages per conversation: a user question, a ``calculate`` call and its
            result, a ``submit`` call and its result, and a final assistant message.

        """
        rng = random.Random(f"arithmetic-demonstrations-{seed}")
        return [_demonstration(cls, rng) for _ in range(n)]


def _task_expression(rng: random.Random) -> str:
    """2 or 3 operations among + - * (at most one *) on integers from 10 to 999."""
    operands = [str(rng.randint(10, 999)) for _ in range(rng.choice((3, 4)))]
    operators = [rng.choice("+-") for _ in operands[1:]]
    operators[rng.randrange(len(operators))] = rng.choice("+-*")  # at most one product
    if rng.random() < 0.4:  # parenthesise the first operation: (a + b) * c
        operands[0] = f"({operands[0]} {operators[0]} {operands[1]})"
        operators, operands = operators[1:], [operands[0]] + operands[2:]
    expression = operands[0]
    for operator, operand in zip(operators, operands[1:], strict=True):
        expression += f" {operator} {operand}"
    return expression


def _demonstration(cls: type[Arithmetic], rng: random.Random) -> list[dict[str, Any]]:
    """One conversation on a one-operation expression, with the real tools' results."""
    expression = f"{rng.randint(1, 9)} {rng.choice('+-*/')} {rng.randint(1, 9)}"
    value = float(calculator(expression))
    answer = int(value) if value.is_integer() else value
    env = cls()
    env.reset(answer=answer)
    result = env.calculate(expression)
    return [
        {"role": "user", "content": _DEMO_PHRASING.format(expression=expression)},
        *tool_turn("calculate", {"expression": expression}, result),
        *tool_turn("submit", {"answer": answer}, env.submit(answer)),
        {"role": "assistant", "content": f"The answer is {result}."},
    ]
