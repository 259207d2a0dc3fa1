"""A tool's result with a reward for the step: ``return Rewarded(text, reward)``.

A tool (a plain ``tools=`` function or an environment's tool method) that knows what its step
was worth returns `Rewarded` around what it would have returned. The model reads only the value,
rendered as any tool result is (`tools.call_tool`); the reward goes to `ToolResult.reward`, and
the rollout engine adds the rewards of a turn's calls to that turn's reward (per-turn credit,
``turn_advantage``). A call that fails (bad arguments, an exception, a timeout) earns 0.

A reward that is not a finite number, or a `Rewarded` inside a list, a tuple or another
`Rewarded`, is the tool author's bug, not the model's: `ToolRewardError` names the function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rewarded:
    """What a tool returns to give its step a reward: the model reads `value` only.

    Attributes:
        value: What the tool would otherwise return (text, data that JSON can encode, images).
        reward: What the step earned: a finite number (bool is refused).

    Examples:
        >>> split_reward(Rewarded("Box 3 opened.", 0.5), "open_box")
        ('Box 3 opened.', 0.5)
        >>> split_reward("Box 3 opened.", "open_box")
        ('Box 3 opened.', 0.0)

    """

    value: Any
    reward: float


class ToolRewardError(TypeError):
    """A tool returned a `Rewarded` whose reward the engine cannot use (the user's bug)."""


def split_reward(value: Any, where: str) -> tuple[Any, float]:
    """(what the model reads, the reward): `value` unwrapped, or `value` and 0.0.

    Args:
        value: What the tool returned.
        where: The tool's function, named in errors.

    Raises:
        ToolRewardError: The reward is not a finite int or float, or a `Rewarded` is nested
            (inside a list, a tuple or another `Rewarded`), where it would reach the model.

    """
    reward = 0.0
    if isinstance(value, Rewarded):
        value, reward = value.value, _checked(value.reward, where)
    inner = value if isinstance(value, list | tuple) else (value,)
    if any(isinstance(part, Rewarded) for part in inner):
        raise ToolRewardError(
            f"tool {where}() returned a Rewarded inside a {type(value).__name__}; return one "
            "Rewarded(value, reward) around the whole result (several rewards: their sum)"
        )
    return value, reward


def _checked(reward: Any, where: str) -> float:
    """`reward` as a float, or a `ToolRewardError` saying what works."""
    number = isinstance(reward, int | float) and not isinstance(reward, bool)
    if not number or not math.isfinite(reward):
        raise ToolRewardError(
            f"tool {where}() returned Rewarded(..., reward={reward!r}); the reward must be a "
            "finite int or float (return the plain value for a step that earns nothing)"
        )
    return float(reward)
