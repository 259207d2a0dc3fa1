"""An environment that answers in words, and scores each turn: ``respond``, ``turn_reward``.

``respond(self, message: str) -> str | None`` is optional. The engine calls it when the model ends
a turn without a tool call, with that turn's text (what the model wrote, tool-call markup and
the end-of-turn token left out). Its text becomes the next user turn (a simulated user's reply,
an opponent's move, a judge's remark) and the episode goes on; None ends the episode (STOP), as
a turn without tool calls does for an environment without ``respond``. It is synchronous, like
``reset``, and runs in a daemon thread under ``environment_timeout_s``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from environments.errors import (
    EnvironmentRespondError,
    EnvironmentRewardError,
    EnvironmentSpecError,
    async_method_message,
)
from tools.threads import describe_error, is_signal


def responds(env_class: type) -> bool:
    """Whether instances of `env_class` answer turns without tool calls (a ``respond`` method)."""
    return inspect.isfunction(inspect.getattr_static(env_class, "respond", None))


def respond_text(env: object, message: str) -> str | None:
    """``env.respond(message)``, checked: the next user turn's text, or None to end the episode.

    Raises:
        EnvironmentRespondError: ``respond`` raised (chained), or returned neither a str nor
            None; the message names the class.
        EnvironmentSpecError: ``respond`` is ``async def``.

    """
    name = type(env).__qualname__
    try:
        reply: Any = env.respond(message)  # type: ignore[attr-defined]
    except BaseException as error:
        if is_signal(error):
            raise
        raise EnvironmentRespondError(f"{name}.respond() raised {describe_error(error)}") from error
    if inspect.iscoroutine(reply):
        reply.close()
        raise EnvironmentSpecError(async_method_message(name, "respond"))
    if reply is not None and not isinstance(reply, str):
        raise EnvironmentRespondError(
            f"{name}.respond() returned {type(reply).__name__}; return the next user turn's "
            "text (a str), or None to end the episode"
        )
    return reply


def gives_turn_rewards(env_class: type) -> bool:
    """Whether instances of `env_class` score each turn (a ``turn_reward`` method)."""
    return inspect.isfunction(inspect.getattr_static(env_class, "turn_reward", None))


def turn_reward_value(env: object) -> float:
    """``env.turn_reward()``, checked: the reward of the turn just played (None reads as 0.0).

    ``turn_reward(self) -> float | None`` is optional. The engine calls it after each model turn
    once its tool calls ran (or the environment replied), so it may read what the turn
    changed; the per-turn credit (``turn_advantage``) uses these rewards, and the episode's
    reward stays ``reward()``'s.

    Raises:
        EnvironmentRewardError: It raised (chained), or returned something other than a
            finite number or None.
        EnvironmentSpecError: It is ``async def``.

    """
    name = type(env).__qualname__
    try:
        value: Any = env.turn_reward()  # type: ignore[attr-defined]
    except BaseException as error:
        if is_signal(error):
            raise
        raise EnvironmentRewardError(
            f"{name}.turn_reward() raised {describe_error(error)}"
        ) from error
    if inspect.iscoroutine(value):
        value.close()
        raise EnvironmentSpecError(async_method_message(name, "turn_reward"))
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EnvironmentRewardError(
            f"{name}.turn_reward() returned {value!r}; return a finite number, or None for 0"
        )
    return float(value)


def state_key_text(env: object) -> str:
    """``env.state_key()``: a text equal for two episodes exactly when their states are equal.

    Optional; ``turn_advantage="same_state"`` compares turns that start from the same state,
    by default the same observation (the messages since the model's last turn).

    Raises:
        EnvironmentSpecError: It raised or returned something other than a str.
    """
    name = type(env).__qualname__
    try:
        key = env.state_key()  # type: ignore[attr-defined]
    except BaseException as error:
        if is_signal(error):
            raise
        raise EnvironmentSpecError(f"{name}.state_key() raised {describe_error(error)}") from error
    if not isinstance(key, str):
        raise EnvironmentSpecError(
            f"{name}.state_key() returned {type(key).__name__}; return a str (e.g. json.dumps "
            "of the state) equal for equal states"
        )
    return key
