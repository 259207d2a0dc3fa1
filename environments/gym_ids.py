"""Registered gymnasium environments by id: ``gym:FrozenLake-v1``, ``gym:Taxi-v4``, ...

`gym_id_environment(spec)` turns the text after ``gym:`` into an environment class through
`gym_environment`, so a registered env needs no code of ours:

- the observation must be text: a `~gymnasium.spaces.Text` observation space, or an ``ansi``
  render mode, whose frame becomes the observation (coloured cells, such as the player's, are
  shown in ``[brackets]``). Anything else (``Blackjack-v1``: a tuple of numbers, no ``ansi``) is
  refused with an `EnvironmentSpecError` that says why;
- the action is the tool ``act``, its argument typed from the action space (`Discrete` or
  `Text`); the toy-text envs gymnasium ships (FrozenLake, Taxi, CliffWalking) have their
  actions, goal and map legend described from gymnasium's documentation, others get the env's
  own docstring and ``get_action_meanings()`` where it has one;
- the reward is the episode return, the sum of the step rewards;
- rows: ``dataset(split)`` gives one prompt per row with a seed (``"train"`` from 0,
  ``"eval"`` from 1,000,000), and each episode resets with its row's seed;
- ``episode_limits``: ``max_turns`` is the env's ``max_episode_steps``, at most 20, and
  ``max_completion_length`` allows each turn a call and the frame it returns.

Keyword arguments for ``gymnasium.make`` follow the id, comma-separated, each value JSON (or a
bare string): ``gym:FrozenLake-v1,is_slippery=false,map_name=8x8``. The same spec gives the same
class every time.
"""

from __future__ import annotations

import difflib
import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium
from gymnasium.spaces import Text

from environments.errors import EnvironmentSpecError
from environments.gym_adapter import GymEnvironment, gym_environment
from tools.threads import describe_error

MAX_TURNS = 20  # a cap on model turns: longer games cost more than they teach a small model
_TURN_TOKENS = 56  # a tool call, the template around it and the frame's "(Down)" line
_TOOL = "act"
_CLASSES: dict[tuple[str, tuple[tuple[str, Any], ...]], type[GymEnvironment]] = {}
_COLOURED = re.compile(r"\x1b\[[0-9;]*m([^\x1b]*)\x1b\[0m")
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FRAME_MAX = 10_000


@dataclass(frozen=True)
class _Described:
    """What gymnasium's documentation says about a toy-text env the frame does not show."""

    goal: str
    actions: str
    describe: Callable[[gymnasium.Env, Any], str] | None = None


def _taxi_state(env: gymnasium.Env, state: Any) -> str:
    """Taxi's state in words (its documented encoding): the frame's colours are lost as text."""
    row, column, passenger, destination = list(env.unwrapped.decode(state))  # type: ignore[attr-defined]
    where = "in the taxi" if passenger == 4 else f"waiting at {'RGYB'[passenger]}"
    return (
        f"Taxi at row {row}, column {column}; passenger {where}; destination {'RGYB'[destination]}."
    )


# Keyed by the env's class name, so variants (FrozenLake8x8-v1, CliffWalkingSlippery-v1) match.
_DESCRIBED = {
    "FrozenLakeEnv": _Described(
        goal="Walk across the frozen lake from the start S to the goal G without falling into a "
        "hole H; F is safe frozen ice and your cell is shown in [brackets]. The ice may be "
        "slippery, so a move can go sideways. Reaching G pays 1.",
        actions="0: move left, 1: move down, 2: move right, 3: move up.",
    ),
    "TaxiEnv": _Described(
        goal="Drive the taxi to the passenger, pick them up, drive to the destination and drop "
        "them off. The four stops are R, G, Y and B; | is a wall. Each step costs 1, a delivery "
        "pays 20, and a wrong pick-up or drop-off costs 10.",
        actions="0: move south (down), 1: move north (up), 2: move east (right), "
        "3: move west (left), 4: pick up the passenger, 5: drop off the passenger.",
        describe=_taxi_state,
    ),
    "CliffWalkingEnv": _Described(
        goal="Walk from the start at the bottom left to the goal T at the bottom right. x is "
        "you, o is safe ground and C is the cliff. Each step costs 1; stepping onto the cliff "
        "costs 100 and sends you back to the start.",
        actions="0: move up, 1: move right, 2: move down, 3: move left.",
    ),
}


class AnsiText(gymnasium.ObservationWrapper):
    """Observations as text: the env's ``ansi`` frame after each reset and step.

    A coloured span (gymnasium's toy-text envs colour the player's cell) becomes ``[span]``;
    other terminal escapes are dropped. ``describe(env, observation)``, if given, adds a line.
    """

    def __init__(
        self, env: gymnasium.Env, describe: Callable[[gymnasium.Env, Any], str] | None = None
    ) -> None:
        super().__init__(env)
        self.observation_space = Text(max_length=_FRAME_MAX, charset=string.printable)
        self._describe = describe

    def observation(self, observation: Any) -> str:
        """The frame the env renders now, as plain text."""
        frame = self.env.render()
        text = frame if isinstance(frame, str) else "".join(map(str, frame or ()))
        text = _ESCAPE.sub("", _COLOURED.sub(r"[\1]", text)).strip("\n")
        if self._describe is not None:
            text += "\n" + self._describe(self.env, observation)
        return text


def gym_id_environment(spec: str) -> type[GymEnvironment]:
    """The environment class for a registered gymnasium id, with optional ``make`` arguments.

    Args:
        spec: ``ENV_ID`` or ``ENV_ID,key=value,...`` (the part after ``gym:``); values are JSON
            (``false``, ``3``, ``"8x8"``) or bare strings.

    Returns:
        A `GymEnvironment` subclass with the tool ``act``, ``dataset(split)`` and
        ``episode_limits``; the same class for the same spec.

    Raises:
        EnvironmentSpecError: The id is not registered (the message lists close matches), the
            module named before it (``gym:MODULE:ENV_ID``) does not import, the arguments are
            malformed or refused by the env, the observation is not text, or the action space
            is neither `Discrete` nor `Text`.

    Examples:
        >>> FrozenLake = gym_id_environment("FrozenLake-v1,is_slippery=false")
        >>> env = FrozenLake()
        >>> print(env.reset(seed=0))
        [S]FFF
        FHFH
        FFFH
        HFFG
        >>> print(env.act(2))
          (Right)
        S[F]FF
        FHFH
        FFFH
        HFFG
        >>> env.close()

    """
    env_id, kwargs = _parse(spec)
    key = (env_id, tuple(sorted(kwargs.items())))
    if key not in _CLASSES:
        _CLASSES[key] = _build(env_id, kwargs, f"gym:{spec}")
    return _CLASSES[key]


def _parse(spec: str) -> tuple[str, dict[str, Any]]:
    env_id, *pairs = spec.split(",")
    env_id = env_id.strip()
    if not env_id:
        raise EnvironmentSpecError(
            f"'gym:{spec}' names no gymnasium id; write gym:ENV_ID, e.g. gym:FrozenLake-v1"
        )
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        name = name.strip()
        if not equals or not name.isidentifier():
            raise EnvironmentSpecError(
                f"'gym:{spec}': {pair!r} is not key=value; make arguments follow the id as "
                f"gym:{env_id},key=value,... (e.g. is_slippery=false)"
            )
        kwargs[name] = _argument(value.strip())
    return env_id, kwargs


def _argument(text: str) -> Any:
    """A `key=value` value: JSON, Python's True, False or None, else the text (`4x4`)."""
    python = {"True": True, "False": False, "None": None}
    if text in python:
        return python[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _build(env_id: str, kwargs: dict[str, Any], label: str) -> type[GymEnvironment]:
    probe = _make(env_id, kwargs, label)
    try:
        observation_space = probe.observation_space
        render_modes = list(probe.metadata.get("render_modes", []))
        unwrapped = probe.unwrapped
        described = _DESCRIBED.get(type(unwrapped).__name__)
        meanings = getattr(unwrapped, "get_action_meanings", None)
        doc = _first_paragraph(type(unwrapped).__doc__)
        max_steps = probe.spec.max_episode_steps if probe.spec is not None else None
    finally:
        probe.close()
    make_env: Callable[[], gymnasium.Env]
    if isinstance(observation_space, Text):
        make_env = lambda: gymnasium.make(env_id, **kwargs)  # noqa: E731
    elif "ansi" in render_modes:
        describe = described.describe if described else None
        make_env = lambda: AnsiText(  # noqa: E731
            gymnasium.make(env_id, render_mode="ansi", **kwargs), describe
        )
    else:
        raise EnvironmentSpecError(
            f"{label} has no text observation, which the model needs: its observation space "
            f"is {observation_space}, not Text, and it has no 'ansi' render mode (its render "
            f"modes: {', '.join(render_modes) or 'none'}). Write a class with "
            f"gym_environment({env_id!r}, observe=<observation -> text>, ...) in a file and "
            f"run path/to/file.py:Class"
        )
    goal = described.goal if described else doc or f"Play the gymnasium game {env_id}."
    actions = described.actions if described else _meanings(meanings)
    try:
        cls = gym_environment(
            make_env,
            name="Gym" + re.sub(r"\W", "_", env_id),
            action_tool=_TOOL,
            action_doc=f"Take one action in {env_id}; returns what you see next.",
            argument_doc=actions,
            prompt=f"{goal} Play {env_id} with the {_TOOL} tool: each call takes one action "
            "and returns what you see next. Aim for the highest total reward.",
            description=f"The gymnasium env {env_id}, played with {_TOOL}; reward: the episode "
            "return.",
        )
    except TypeError as error:  # an action space the adapter cannot offer as a tool argument
        raise EnvironmentSpecError(f"{label}: {error}") from None
    cls.episode_limits = _limits(cls, max_steps)  # type: ignore[attr-defined]
    return cls


# What an env's constructor raises for arguments it refuses: an unknown name (TypeError), a
# value it cannot use (FrozenLake's map_name=9x9: KeyError; others: ValueError, an assert).
_REFUSED_ARGUMENTS = (TypeError, LookupError, ValueError, AssertionError)


def _make(env_id: str, kwargs: dict[str, Any], label: str) -> gymnasium.Env:
    """Make one env to read its spaces; a missing id, module or a refused argument is the user's.

    Each is an `EnvironmentSpecError` naming `label` (the spec) and keeping the original
    error's text. Anything else the env raises is its own bug and propagates.
    """
    try:
        return gymnasium.make(env_id, **kwargs)
    except gymnasium.error.Error as error:
        raise EnvironmentSpecError(
            f"{label}: {str(error).rstrip('.')}{_close_matches(env_id)}"
        ) from None
    except ImportError as error:  # e.g. gym:MODULE:ENV_ID, and MODULE does not import
        raise EnvironmentSpecError(
            f"{label}: gymnasium.make({env_id!r}) could not import a module it needs "
            f"({describe_error(error)}); install it, or put its folder on sys.path (PYTHONPATH)"
        ) from error
    except _REFUSED_ARGUMENTS as error:
        raise EnvironmentSpecError(
            f"{label}: gymnasium.make({env_id!r}, {kwargs}) refused its arguments: "
            f"{describe_error(error)}"
        ) from error


def _close_matches(env_id: str) -> str:
    ids = list(gymnasium.registry)
    close = difflib.get_close_matches(env_id, ids, n=5, cutoff=0.5)
    toy = [key for key, spec in gymnasium.registry.items() if "toy_text" in str(spec.entry_point)]
    found = f"; close matches: {', '.join(close)}" if close else ""
    return f"{found}; registered toy-text ids: {', '.join(toy)}"


def _meanings(get_action_meanings: Callable[[], Any] | None) -> str | None:
    if get_action_meanings is None:
        return None  # the adapter describes the action space in words
    return ", ".join(f"{i}: {m}" for i, m in enumerate(get_action_meanings())) + "."


def _first_paragraph(doc: str | None) -> str:
    paragraph = (doc or "").strip().split("\n\n")[0]
    text = " ".join(paragraph.split())
    return text if text and not text.startswith("#") else ""


def _limits(cls: type[GymEnvironment], max_steps: int | None) -> dict[str, int]:
    """Turns: the env's step limit, at most `MAX_TURNS`; tokens: each turn a call and a frame.

    The frame's length is read from one reset; a frame of n characters is taken as at most
    3n/4 tokens (SmolLM2's tokenizer: FrozenLake 21 characters, 17 tokens; CliffWalking 139, 95).
    """
    env = cls()
    try:
        frame = env.reset(seed=0)
    finally:
        env.close()
    turns = min(max_steps or MAX_TURNS, MAX_TURNS)
    return {
        "max_turns": turns,
        "max_completion_length": turns * (_TURN_TOKENS + len(frame) * 3 // 4),
    }
