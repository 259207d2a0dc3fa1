"""Turning a `gymnasium.Env` with text observations into an environment class.

`gym_environment(make_env, ...)` returns a class that meets the Environment contract:

- ``reset(seed=None, **row)`` makes the gym env (once per instance), resets it with the group's
  seed (and, as ``options``, the row columns named in ``options``) and returns the observation
  as text;
- one tool, named ``action_tool``, whose argument is typed from the action space (``int`` for
  `~gymnasium.spaces.Discrete`, ``str`` for `~gymnasium.spaces.Text`). It checks the action
  (an invalid one raises `ValueError`, which the engine turns into an error message for the
  model; the env is not stepped), calls ``env.step``, adds the step reward, sets ``done`` when
  the episode is terminated or truncated, and returns the next observation as text, marked
  ``(episode over)`` or ``(out of steps: episode over)`` on the last step;
- ``reward()``: the sum of the step rewards, the episode's reward; ``turn_reward()``: the
  rewards of the steps since it was last read, so each step's reward is its turn's (per-turn
  credit, ``turn_advantage``; the default ``"episode"`` reads only the sum); ``close()``:
  closes the gym env;
- ``terminated``, ``truncated``, ``steps`` and ``total_reward`` attributes, kept apart as
  gymnasium keeps them (the task ended versus we cut it off);
- with ``prompt=``, a ``dataset(split)`` classmethod, so the class runs without data files.

Observations become text: a `~gymnasium.spaces.Text` observation is read as it is, a
`~gymnasium.spaces.Dict` or `~gymnasium.spaces.Tuple` one through the default rendering
`environments.observations.observation_text` (keys and indices as labels, small arrays as rows
of numbers), and any space through an ``observe`` function that renders an observation as text,
which takes precedence. The class is built once, when `gym_environment` is called: it makes one
env to read its spaces, then closes it.

With ``max_episode_steps``, the class also gets ``episode_limits``: ``max_turns`` is the step
limit (one step per turn), and ``max_completion_length`` allows each turn a call
(`TURN_TOKENS`) and an observation as long as the first one (read from one ``reset(seed=0)``
of the probed env; a class with ``options`` gets ``max_turns`` alone, as its reset needs a row).

Add ``demonstrations``, a richer ``dataset`` or reward shaping by subclassing the returned class.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import gymnasium
from gymnasium.spaces import Dict, Discrete, Text, Tuple

from environments.contract import RESERVED_NAMES
from environments.observations import observation_text

if TYPE_CHECKING:
    import datasets

_ROWS = {"train": 256, "eval": 64}
_FIRST_SEED = {"train": 0, "eval": 1_000_000}  # eval games never share a seed with train ones
TURN_TOKENS = 56
"""Tokens a turn takes besides its observation: a tool call, the template around it, a mark."""


@dataclass(frozen=True)
class GymSpec:
    """What a `GymEnvironment` class needs to play its gym env; built by `gym_environment`.

    Attributes:
        make_env: Makes a fresh gym env; called once per environment instance.
        observe: Renders an observation as the text the model reads.
        action_space: The env's action space, `Discrete` or `Text`.
        argument: The name of the action tool's argument, used in error messages.
        max_episode_steps: Steps after which the adapter truncates the episode; None: no limit
            of its own (the env may still truncate).
        options: Row columns passed to ``env.reset(options=...)``.

    """

    make_env: Callable[[], gymnasium.Env]
    observe: Callable[[Any], str]
    action_space: Discrete | Text
    argument: str
    max_episode_steps: int | None
    options: tuple[str, ...]


class GymEnvironment:
    """Base of the classes `gym_environment` builds: one gym env per instance, played by a tool.

    Subclasses get ``_gym`` (a `GymSpec`) and their tool method from `gym_environment`.
    """

    _gym: ClassVar[GymSpec]
    reward_sums_turns: ClassVar[bool] = True  # `reward()` is the sum of the `turn_reward()`s
    env: gymnasium.Env | None = None
    done: bool = False

    def reset(self, seed: int | None = None, **row: Any) -> str:
        """Reset the gym env with the group's seed and return the first observation as text.

        Args:
            seed: The group's seed; members of a group get the same one, hence the same game.
            **row: The dataset row; the columns named in the spec's ``options`` are passed to
                ``env.reset(options=...)``, the others are ignored.

        Raises:
            KeyError: The row lacks a column named in ``options``.

        """
        spec = self._gym
        missing = [name for name in spec.options if name not in row]
        if missing:
            raise KeyError(f"the row lacks the column(s) {missing} named in options")
        if self.env is None:
            self.env = spec.make_env()
        options = {name: row[name] for name in spec.options} or None
        observation, _ = self.env.reset(seed=seed, options=options)
        self.total_reward = self._earned = 0.0
        self.steps = 0
        self.terminated = self.truncated = self.done = False
        # The engine runs one instance's calls one at a time, but a call abandoned on timeout
        # may still be stepping when the next starts; a gym env is not thread-safe.
        self._stepping = threading.Lock()
        return _text(spec.observe(observation))

    def reward(self) -> float:
        """The sum of the rewards of the steps taken so far."""
        return self.total_reward

    def turn_reward(self) -> float:
        """The rewards of the steps taken since the last call: the turn's reward.

        The engine calls it after each model turn, so a turn's step (one call a turn, as a
        model usually makes) earns gymnasium's reward for that step.
        """
        earned, self._earned = self._earned, 0.0
        return earned

    def close(self) -> None:
        """Close the gym env (if one was made); a later `reset` makes a new one."""
        if self.env is not None:
            self.env.close()
            self.env = None

    def _act(self, action: Any) -> str:
        """What the tool method calls: take the action, one call at a time."""
        env = self.env
        if env is None:
            raise RuntimeError(f"{type(self).__qualname__}: call reset() before acting")
        with self._stepping:
            return self._step(env, action)

    def _step(self, env: gymnasium.Env, action: Any) -> str:
        """Check the action, step `env` (this instance's), and return the observation as text."""
        spec = self._gym
        if self.done:
            raise ValueError("the episode is over; no more actions are accepted")
        problem = _invalid_action(spec.action_space, spec.argument, action)
        if problem:
            raise ValueError(problem)
        observation, reward, terminated, truncated, _ = env.step(action)
        self.steps += 1
        self.total_reward += float(reward)
        self._earned += float(reward)
        limit = spec.max_episode_steps
        self.terminated = bool(terminated)
        self.truncated = not self.terminated and (
            bool(truncated) or (limit is not None and self.steps >= limit)
        )
        self.done = self.terminated or self.truncated
        text = _text(spec.observe(observation))
        if self.terminated:
            return text + " (episode over)"
        if self.truncated:
            return text + " (out of steps: episode over)"
        return text


class PromptRows:
    """Mixin: a ``dataset`` of the class's ``prompt`` text, for a game that needs no data files."""

    prompt: ClassVar[str]

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Task rows: ``prompt`` (``cls.prompt`` as one user message) and ``seed``, one per row.

        Args:
            split: ``"train"`` (256 rows) or ``"eval"`` (64 rows); the seeds of the two never
                overlap. The engine's group seed, when it gives one, takes precedence.

        """
        if split not in _ROWS:
            raise ValueError(f"{cls.__qualname__} has splits {sorted(_ROWS)}, not {split!r}")
        import datasets  # here, not at the top: importing it takes about a second

        seeds = list(range(_FIRST_SEED[split], _FIRST_SEED[split] + _ROWS[split]))
        messages = [[{"role": "user", "content": cls.prompt}] for _ in seeds]
        return datasets.Dataset.from_dict({"prompt": messages, "seed": seeds})


def gym_environment(
    make_env: Callable[[], gymnasium.Env] | str,
    *,
    action_doc: str,
    name: str | None = None,
    action_tool: str = "act",
    argument: str = "action",
    argument_doc: str | None = None,
    observe: Callable[[Any], str] | None = None,
    max_episode_steps: int | None = None,
    options: Sequence[str] = (),
    prompt: str | None = None,
    description: str | None = None,
) -> type[GymEnvironment]:
    """Build an environment class that plays a gymnasium env through one tool.

    Args:
        make_env: A zero-argument callable returning a fresh gym env (a class works), or a
            registered gymnasium id, made with `gymnasium.make`.
        action_doc: The tool's description, as the model reads it, e.g. "Guess the number."
        name: The class name; defaults to the env's class name plus ``Environment``.
        action_tool: The tool's name, a public identifier outside the contract's names.
        argument: The name of the tool's one argument.
        argument_doc: The argument's description; defaults to the action space in words
            ("An integer from 0 to 3.").
        observe: Renders an observation as text; required unless the observation space is
            `Text` (read as it is), `Dict` or `Tuple` (`observation_text` by default).
        max_episode_steps: Truncate the episode after this many steps, and give the class
            ``episode_limits`` of that many turns (`step_limits`); None: only the env
            truncates, and the class has no ``episode_limits`` of its own.
        options: Row columns passed to ``env.reset(options={column: value})``; reset fails
            with a clear error when the row lacks one.
        prompt: If given, the class gets a ``dataset(split)`` classmethod: this prompt as one
            user message, 256 ``"train"`` rows or 64 ``"eval"`` rows, each with its own
            ``seed`` (the engine's group seed takes precedence over it).
        description: The class docstring; its first line is what ``agentgrpo envs`` lists.

    Returns:
        A `GymEnvironment` subclass with the tool method ``action_tool``.

    Raises:
        TypeError: The action space is neither `Discrete` nor `Text`, or the observation
            space is not `Text`, `Dict` or `Tuple` and no ``observe`` was given.
        ValueError: ``action_tool`` or ``argument`` is not a usable name, or
            ``max_episode_steps`` is below 1.

    Examples:
        >>> from environments.guess_number import GuessNumberGame
        >>> Guess = gym_environment(
        ...     lambda: GuessNumberGame(high=4), action_tool="guess", action_doc="Guess."
        ... )
        >>> env = Guess()
        >>> env.reset(seed=0)
        "I'm thinking of a whole number from 1 to 4. You have 3 guesses."
        >>> env.guess(5)
        Traceback (most recent call last):
        ...
        ValueError: action 5 is out of range: it must be from 1 to 4
        >>> env.guess(env.env.secret), env.done, env.reward()
        ('Correct! (episode over)', True, 1.0)

    """
    _check_arguments(action_tool, argument, max_episode_steps)
    if isinstance(make_env, str):
        make_env = functools.partial(gymnasium.make, make_env)
    measure = max_episode_steps is not None and not options
    env_name, action_space, observe, frame = _probe(make_env, observe, measure)
    spec = GymSpec(make_env, observe, action_space, argument, max_episode_steps, tuple(options))
    class_name = name or f"{env_name}Environment"
    doc = argument_doc or _describe_space(action_space)
    tool = _tool_method(class_name, action_tool, argument, action_space, action_doc, doc)
    description = description or (
        f"The gymnasium env {env_name} as an environment: the model acts with {action_tool}."
    )
    namespace = {"__doc__": description, "__module__": _caller_module(), "_gym": spec}
    if max_episode_steps is not None:
        namespace["episode_limits"] = step_limits(max_episode_steps, frame)
    return _environment_class(class_name, {**namespace, action_tool: tool}, prompt)


def _environment_class(
    name: str, namespace: dict[str, Any], prompt: str | None
) -> type[GymEnvironment]:
    """A `GymEnvironment` subclass holding `namespace`; with a `prompt`, `PromptRows` too."""
    if prompt is None:
        return type(name, (GymEnvironment,), namespace)
    return type(name, (GymEnvironment, PromptRows), {**namespace, "prompt": prompt})


def step_limits(steps: int, frame: str | None) -> dict[str, int]:
    """``episode_limits`` for an episode of `steps` steps, one per turn.

    ``max_turns`` is `steps`; with the first observation's text `frame`,
    ``max_completion_length`` allows each turn `TURN_TOKENS` and a frame of that length, taken
    as 3 tokens per 4 characters (SmolLM2's tokenizer: FrozenLake's 21 characters are 17 tokens,
    CliffWalking's 139 are 95). Without a frame, ``max_turns`` alone.

    Examples:
        >>> step_limits(5, "You are on square 0.")
        {'max_turns': 5, 'max_completion_length': 355}

    """
    if frame is None:
        return {"max_turns": steps}
    return {
        "max_turns": steps,
        "max_completion_length": steps * (TURN_TOKENS + len(frame) * 3 // 4),
    }


def _probe(
    make_env: Callable[[], gymnasium.Env], observe: Callable[[Any], str] | None, measure: bool
) -> tuple[str, Discrete | Text, Callable[[Any], str], str | None]:
    """Make one env to read its name and spaces; check them; return the observation renderer.

    With `measure`, the probe is also reset (seed 0) and its first observation's text returned.

    Raises:
        TypeError: The action space is neither `Discrete` nor `Text`, or the observation space
            is not `Text`, `Dict` or `Tuple` and `observe` is None.

    """
    probe = make_env()
    if not isinstance(probe, gymnasium.Env):
        raise TypeError(
            f"gym_environment: make_env returned a {type(probe).__name__}, not a "
            "gymnasium.Env (with action_space and observation_space); wrap it in one (a GEM "
            "env: environments.gem_adapter.GemText, or the spec gem:ENV_ID)"
        )
    try:
        action_space, observation_space = probe.action_space, probe.observation_space
        env_name = type(probe.unwrapped).__name__
        render = observe or _default_observe(observation_space)
        frame = _text(render(probe.reset(seed=0)[0])) if measure and render else None
    finally:
        probe.close()
    label = f"gym_environment({env_name})"
    if not isinstance(action_space, Discrete | Text):
        raise TypeError(
            f"{label}: the action space is {action_space}; the adapter supports Discrete "
            "(an int argument) and Text (a str argument): wrap the env to map one of these "
            "to its actions"
        )
    if render is None:
        raise TypeError(
            f"{label}: the observation space is {observation_space}, not Text, Dict or Tuple; "
            "pass observe=<a function from an observation to the text the model reads>"
        )
    return env_name, action_space, render, frame


def _default_observe(space: gymnasium.Space) -> Callable[[Any], str] | None:
    """How an observation of `space` becomes text without an ``observe``; None: it cannot."""
    if isinstance(space, Text):
        return str
    if isinstance(space, Dict | Tuple):
        return observation_text
    return None


def _check_arguments(action_tool: str, argument: str, max_episode_steps: int | None) -> None:
    """Raise ValueError, saying what to pick instead, for an unusable name or step limit."""
    if max_episode_steps is not None and max_episode_steps < 1:
        raise ValueError(f"max_episode_steps={max_episode_steps} must be at least 1, or None")
    for what, value in (("action_tool", action_tool), ("argument", argument)):
        if not value.isidentifier() or keyword.iskeyword(value) or value.startswith("_"):
            raise ValueError(f"{what}={value!r} must be a public Python identifier")
    if action_tool in RESERVED_NAMES or any(
        hasattr(base, action_tool) for base in (GymEnvironment, PromptRows)
    ):
        raise ValueError(
            f"action_tool={action_tool!r} is taken by the environment contract; pick another"
        )
    if argument == "self":
        raise ValueError("argument='self' is taken by the method's receiver; pick another")


def _tool_method(
    class_name: str,
    tool: str,
    argument: str,
    space: Discrete | Text,
    action_doc: str,
    argument_doc: str,
) -> Callable[..., str]:
    """Make the tool method: a real signature ``(self, <argument>: int | str) -> str``.

    The parameter's name is chosen at run time, so the function takes ``*args, **kwargs`` and
    carries the signature and annotations that `inspect` and the schema builder read.
    """
    hint = int if isinstance(space, Discrete) else str
    signature = inspect.Signature(
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter(argument, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hint),
        ],
        return_annotation=str,
    )

    def method(*args: Any, **kwargs: Any) -> str:
        bound = signature.bind(*args, **kwargs)
        return bound.arguments["self"]._act(bound.arguments[argument])

    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__annotations__ = {argument: hint, "return": str}
    method.__name__ = tool
    method.__qualname__ = f"{class_name}.{tool}"
    method.__doc__ = f"{action_doc}\n\nArgs:\n    {argument}: {argument_doc}\n"
    return method


def _describe_space(space: Discrete | Text) -> str:
    if isinstance(space, Discrete):
        start = int(space.start)
        return f"An integer from {start} to {start + int(space.n) - 1}."
    return f"Text of {space.min_length} to {space.max_length} characters."


def _invalid_action(space: Discrete | Text, argument: str, action: Any) -> str | None:
    """Say what is wrong with an action, in words the model can act on; None if it is valid."""
    if isinstance(space, Discrete):
        start, stop = int(space.start), int(space.start) + int(space.n)
        if isinstance(action, bool) or not isinstance(action, int):
            return f"{argument} must be an integer, got {action!r}"
        if not start <= action < stop:
            return f"{argument} {action} is out of range: it must be from {start} to {stop - 1}"
        return None
    if not isinstance(action, str):
        return f"{argument} must be a string, got {action!r}"
    if not space.min_length <= len(action) <= space.max_length:
        return (
            f"{argument} has {len(action)} characters; it must have "
            f"{space.min_length} to {space.max_length}"
        )
    refused = sorted(set(action) - set(space.character_set))
    if refused:
        return f"{argument} contains characters that are not allowed: {''.join(refused)!r}"
    return None


def _text(observation_text: object) -> str:
    if not isinstance(observation_text, str):
        raise TypeError(f"observe() returned {type(observation_text).__name__}; it must return str")
    return observation_text


def _caller_module() -> str:
    """The module that called `gym_environment`, so the class's ``__module__`` is its own.

    As `collections.namedtuple` does: two frames up is the caller of `gym_environment`.
    """
    try:
        return sys._getframe(2).f_globals.get("__name__", __name__)
    except (AttributeError, ValueError):
        return __name__
