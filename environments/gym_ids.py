"""Registered gymnasium environments by id: ``gym:FrozenLake-v1``, ``gym:Taxi-v4``, ...

`gym_id_environment(spec)` turns the text after ``gym:`` into an environment class through
`gym_environment`, so a registered env needs no code of ours:

- the observation becomes text: a `~gymnasium.spaces.Text` observation space is read as it is;
  an ``ansi`` render mode's frame becomes the observation (coloured cells, such as the
  player's, are shown in ``[brackets]``); a `~gymnasium.spaces.Dict` or
  `~gymnasium.spaces.Tuple` observation (``Blackjack-v1``'s tuple of numbers) is rendered by
  `environments.observations.observation_text`, and MiniGrid's by
  `environments.observations.minigrid_text` (the mission, the direction, the view as a grid).
  Anything else (``CartPole-v1``: an array, no ``ansi``) is refused with an
  `EnvironmentSpecError` that says why;
- ids of plugin packages (minigrid) exist once their package is imported: ``gym:MODULE:ENV_ID``
  has gymnasium import it (``gym:minigrid:MiniGrid-Empty-5x5-v0``), and ``gym:ENV_ID`` for an id
  that an installed package registers is an error that names that spec;
- the action is the tool ``act``, its argument typed from the action space (`Discrete` or
  `Text`); the toy-text envs gymnasium ships (FrozenLake, Taxi, CliffWalking) and MiniGrid's
  envs have their actions, goal and map legend described from their documentation, others get
  the env's own docstring and ``get_action_meanings()`` where it has one;
- the reward is the episode return, the sum of the step rewards;
- rows: ``dataset(split)`` gives one prompt per row with a seed (``"train"`` from 0,
  ``"eval"`` from 1,000,000), and each episode resets with its row's seed;
- ``episode_limits``: ``max_turns`` is the env's ``max_episode_steps`` (else its own
  ``max_steps``, as MiniGrid's envs have), at most 20, and
  ``max_completion_length`` allows each turn a call and the frame it returns.

Keyword arguments for ``gymnasium.make`` follow the id, comma-separated, each value JSON (or a
bare string): ``gym:FrozenLake-v1,is_slippery=false,map_name=8x8``. The same spec gives the same
class every time.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium
from gymnasium.spaces import Dict, Text, Tuple

from environments.errors import EnvironmentSpecError
from environments.gym_adapter import GymEnvironment, gym_environment, step_limits
from environments.observations import minigrid_text, observation_text
from tools.threads import describe_error

MAX_TURNS = 20  # a cap on model turns: longer games cost more than they teach a small model
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
    observe: Callable[[Any], str] | None = None  # for an observation that is not text


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


# Every MiniGrid env (a subclass of minigrid's MiniGridEnv), from MiniGrid's documentation.
_MINIGRID = _Described(
    goal="Move through a grid world, seen from where you stand, to do what the mission says "
    "(each view states it). Success pays 1 less 0.9 times the share of the step limit used, so "
    "fewer steps pay more.",
    actions="0: turn left, 1: turn right, 2: move forward, 3: pick up the object in front of "
    "you, 4: drop what you carry, 5: toggle the object in front of you (open a door or a box), "
    "6: done (say the task is complete).",
    observe=minigrid_text,
)


def _described(env: gymnasium.Env) -> _Described | None:
    """What the documentation says about the unwrapped `env`'s game, where we know it."""
    classes = [cls.__name__ for cls in type(env).__mro__]
    if "MiniGridEnv" in classes:
        return _MINIGRID
    return _DESCRIBED.get(classes[0])


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
    env_id, kwargs = parse_spec(spec)
    key = (env_id, tuple(sorted(kwargs.items())))
    if key not in _CLASSES:
        _CLASSES[key] = _build(env_id, kwargs, f"gym:{spec}")
    return _CLASSES[key]


def parse_spec(
    spec: str, prefix: str = "gym:", example: str = "FrozenLake-v1"
) -> tuple[str, dict[str, Any]]:
    """Split ``ENV_ID,key=value,...`` (the text after `prefix`) into the id and its arguments.

    Values are JSON, Python's ``True``, ``False`` or ``None``, else the bare text.

    Raises:
        EnvironmentSpecError: No id, or an argument that is not ``key=value``; the message
            shows `prefix` and `example`.

    """
    env_id, *pairs = spec.split(",")
    env_id = env_id.strip()
    if not env_id:
        raise EnvironmentSpecError(
            f"'{prefix}{spec}' names no environment id; write {prefix}ENV_ID, e.g. "
            f"{prefix}{example}"
        )
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        name = name.strip()
        if not equals or not name.isidentifier():
            raise EnvironmentSpecError(
                f"'{prefix}{spec}': {pair!r} is not key=value; make arguments follow the id as "
                f"{prefix}{env_id},key=value,... (e.g. max_turns=5)"
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
        described = _described(unwrapped)
        meanings = getattr(unwrapped, "get_action_meanings", None)
        doc = _first_paragraph(type(unwrapped).__doc__)
        max_steps = probe.spec.max_episode_steps if probe.spec is not None else None
        own_steps = getattr(unwrapped, "max_steps", None)  # MiniGrid truncates by itself
        max_steps = max_steps or (own_steps if isinstance(own_steps, int) else None)
    finally:
        probe.close()
    make_env, observe = _observed(env_id, kwargs, observation_space, render_modes, described)
    if make_env is None:
        raise EnvironmentSpecError(
            f"{label} has no text observation, which the model needs: its observation space "
            f"is {observation_space}, not Text, Dict or Tuple, and it has no 'ansi' render mode "
            f"(its render modes: {', '.join(render_modes) or 'none'}). Write a class with "
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
            observe=observe,
            prompt=f"{goal} Play {env_id} with the {_TOOL} tool: each call takes one action "
            "and returns what you see next. Aim for the highest total reward.",
            description=f"The gymnasium env {env_id}, played with {_TOOL}; reward: the episode "
            "return.",
        )
    except TypeError as error:  # an action space the adapter cannot offer as a tool argument
        raise EnvironmentSpecError(f"{label}: {error}") from None
    cls.episode_limits = _limits(cls, max_steps)  # type: ignore[attr-defined]
    return cls


def _observed(
    env_id: str,
    kwargs: dict[str, Any],
    space: gymnasium.Space,
    render_modes: list[str],
    described: _Described | None,
) -> tuple[Callable[[], gymnasium.Env] | None, Callable[[Any], str] | None]:
    """How to make the env so that its observation becomes text, and the renderer to use.

    A `Text` observation is read as it is; else an ``ansi`` frame (`AnsiText`); else MiniGrid's
    or a `Dict` or `Tuple` observation through its renderer. ``(None, None)``: none of these.
    """
    if isinstance(space, Text):
        return (lambda: gymnasium.make(env_id, **kwargs)), None
    if "ansi" in render_modes:
        describe = described.describe if described else None
        return (
            lambda: AnsiText(gymnasium.make(env_id, render_mode="ansi", **kwargs), describe)
        ), None
    observe = described.observe if described else None
    if observe is None and isinstance(space, Dict | Tuple):
        observe = observation_text
    if observe is None:
        return None, None
    return (lambda: gymnasium.make(env_id, **kwargs)), observe


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
    except gymnasium.error.NameNotFound as error:
        found = _plugin_hint(env_id, label) or _close_matches(env_id)
        raise EnvironmentSpecError(f"{label}: {str(error).rstrip('.')}{found}") from None
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


_OURS = {"agentgrpo", "environments", "rollout", "tools"}
_NEEDS_GYMNASIUM = re.compile(r"gymnasium(?![\w.-])", re.IGNORECASE)


def _plugin_hint(env_id: str, label: str) -> str:
    """For an id an installed plugin package registers on import: the spec that imports it.

    The plugins are the installed distributions that require gymnasium (not in an extra); each
    of their modules is imported until `env_id` is registered. Empty: none registers it.
    """
    if ":" in env_id:  # gym:MODULE:ENV_ID names its module already
        return ""
    for module in _plugin_modules():
        try:
            importlib.import_module(module)
        except Exception:  # a plugin that does not import here cannot register the id
            continue
        if env_id in gymnasium.registry:
            spec = label.replace("gym:", f"gym:{module}:", 1)
            return (
                f"; the installed package {module!r} registers it when imported, which "
                f"gym:MODULE:ENV_ID does: use {spec}"
            )
    return ""


def _plugin_modules() -> list[str]:
    """Top-level modules of the installed distributions that require gymnasium, ours left out."""
    plugins = {
        _normalized(dist.metadata["Name"] or "")
        for dist in importlib.metadata.distributions()
        if any(
            _NEEDS_GYMNASIUM.match(requirement) and "extra ==" not in requirement
            for requirement in dist.requires or []
        )
    }
    owners = importlib.metadata.packages_distributions()
    return sorted(
        module
        for module, dists in owners.items()
        if module.isidentifier()
        and module not in _OURS
        and any(_normalized(dist) in plugins for dist in dists)
    )


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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

    The frame's length is read from one reset (`step_limits` says how it counts).
    """
    env = cls()
    try:
        frame = env.reset(seed=0)
    finally:
        env.close()
    return step_limits(min(max_steps or MAX_TURNS, MAX_TURNS), frame)
