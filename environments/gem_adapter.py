r"""GEM's environments by id: ``gem:game:GuessTheNumber-v0-easy``, ``gem:game:Sudoku-v0-easy``, ...

`gem_environment(spec)` turns the text after ``gem:`` into an environment class. GEM (the
``gem-llm`` package, 0.1.0) keeps its own registry of text environments (``gem.make(ID)``) with
gymnasium's ``reset(seed)`` and ``step(action)`` but not its spaces, so a `GemText` wrapper gives
them `~gymnasium.spaces.Text` spaces and `gym_environment` does the rest:

- the task is GEM's first observation (its instructions), the prompt of each row a line that
  introduces it; rows are one prompt per seed (``"train"`` from 0, ``"eval"`` from 1,000,000),
  and each episode resets with its row's seed (or the engine's group seed);
- the action is one tool, ``act(action: str)``, rather than the model's reply (GEM's own loop
  reads the reply): GEM's games read the move inside ``\boxed{...}``, and an action without
  ``\boxed{`` is boxed for the model, so ``act("42")`` plays ``\boxed{42}``;
- the reward is the episode return, the sum of GEM's step rewards; the episode ends when GEM
  ends it;
- ``episode_limits``: ``max_turns`` is the env's ``max_turns`` (its own limit), at most
  `MAX_TURNS`, and ``max_completion_length`` allows each turn a call and a text as long as the
  instructions.

GEM seeds Python's and numpy's global generators in ``reset`` and draws the game from them, so
resets and steps of all GEM envs in the process run one at a time under one lock: two episodes
resetting at once could otherwise swap games. Importing ``gem`` configures the root logger
(``logging.basicConfig``); that setting is undone, so agentgrpo's logging stays as it was.

Keyword arguments for ``gem.make`` follow the id as for ``gym:``:
``gem:game:GuessTheNumber-v0-random,max_turns=5``.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
import threading
from typing import Any

import gymnasium
from gymnasium.spaces import Text

from environments.errors import EnvironmentSpecError
from environments.gym_adapter import GymEnvironment, gym_environment, step_limits
from environments.gym_ids import MAX_TURNS, parse_spec
from tools.threads import describe_error

GEM_PREFIX = "gem:"
INSTALL = "pip install 'agentgrpo[gem]'"
_TOOL = "act"
_ACTION_MAX = 1000
_TEXT_MAX = 100_000
_GLOBAL_RANDOM = threading.Lock()  # GEM draws its games from the global generators
_CLASSES: dict[tuple[str, tuple[tuple[str, Any], ...]], type[GymEnvironment]] = {}


class GemText(gymnasium.Env):
    r"""A GEM env as a gymnasium env: `Text` actions and observations, GEM's rewards and ends.

    An action without ``\boxed{`` is passed as ``\boxed{action}``, the form GEM's games read.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's attribute)

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        self.gem_env = make_gem(env_id, kwargs)
        self.action_space = Text(min_length=1, max_length=_ACTION_MAX, charset=string.printable)
        self.observation_space = Text(max_length=_TEXT_MAX, charset=string.printable)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """GEM's ``reset(seed)``: its first observation (the instructions) and info."""
        super().reset(seed=seed)
        with _GLOBAL_RANDOM:
            observation, info = self.gem_env.reset(seed=seed)
        return str(observation), dict(info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """GEM's ``step`` with `action`, boxed when it is not already."""
        move = action if "\\boxed{" in action else f"\\boxed{{{action}}}"
        with _GLOBAL_RANDOM:
            observation, reward, terminated, truncated, info = self.gem_env.step(move)
        return str(observation), float(reward), bool(terminated), bool(truncated), dict(info)


def gem_environment(spec: str) -> type[GymEnvironment]:
    """The environment class for a GEM id, with optional ``gem.make`` arguments.

    Args:
        spec: ``ENV_ID`` or ``ENV_ID,key=value,...`` (the part after ``gem:``), e.g.
            ``game:GuessTheNumber-v0-easy``; values are JSON or bare strings.

    Returns:
        A `GymEnvironment` subclass with the tool ``act``, ``dataset(split)`` and
        ``episode_limits``; the same class for the same spec.

    Raises:
        EnvironmentSpecError: gem-llm is not installed, the id is not in GEM's registry (the
            message lists close matches), the arguments are malformed or refused, or the env
            fails to start.

    """
    env_id, kwargs = parse_spec(spec, GEM_PREFIX, "game:GuessTheNumber-v0-easy")
    key = (env_id, tuple(sorted(kwargs.items())))
    if key not in _CLASSES:
        _CLASSES[key] = _build(env_id, kwargs)
    return _CLASSES[key]


def make_gem(env_id: str, kwargs: dict[str, Any]) -> Any:
    """``gem.make(env_id, **kwargs)``; a missing package or id, or a refusal, is the user's.

    Raises:
        EnvironmentSpecError: As `gem_environment` says.

    """
    label = f"{GEM_PREFIX}{env_id}"
    gem = _import_gem(label)
    registry = gem.envs.registration.ENV_REGISTRY
    if env_id not in registry:
        games = sorted(name for name in registry if name.startswith("game:"))
        close = _close(env_id, list(registry))
        raise EnvironmentSpecError(
            f"{label}: GEM has no environment {env_id!r}{close}; its games: {', '.join(games)}"
        )
    try:
        return gem.make(env_id, **kwargs)
    except Exception as error:
        raise EnvironmentSpecError(
            f"{label}: gem.make({env_id!r}, {kwargs}) failed: {describe_error(error)}"
        ) from error


def _build(env_id: str, kwargs: dict[str, Any]) -> type[GymEnvironment]:
    probe = GemText(env_id, **kwargs)
    try:
        instructions, _ = probe.reset(seed=0)
        own_limit = getattr(probe.gem_env, "max_turns", None)
    finally:
        probe.close()
    turns = min(own_limit, MAX_TURNS) if isinstance(own_limit, int) else MAX_TURNS
    cls = gym_environment(
        lambda: GemText(env_id, **kwargs),
        name="Gem" + re.sub(r"\W", "_", env_id),
        action_tool=_TOOL,
        action_doc=f"Make one move in the GEM game {env_id}; returns what happens next.",
        argument_doc="Your move, as the instructions ask for it; \\boxed{...} may be left out.",
        prompt=f"Play the GEM game {env_id} with the {_TOOL} tool: each call makes one move "
        "and returns what happens next. The instructions follow.",
        description=f"The GEM env {env_id}, played with {_TOOL}; reward: the episode return.",
    )
    cls.episode_limits = step_limits(turns, instructions)  # type: ignore[attr-defined]
    return cls


def _import_gem(label: str) -> Any:
    """``import gem``, its root-logger setting undone; a missing package says how to install."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import gem
        import gem.envs.registration
    except ImportError as error:
        raise EnvironmentSpecError(
            f"{label} needs GEM (gem-llm), which does not import here ({describe_error(error)}); "
            f"install it: {INSTALL}"
        ) from error
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return gem


def _close(env_id: str, ids: list[str]) -> str:
    close = difflib.get_close_matches(env_id, ids, n=5, cutoff=0.6)
    return f" (close matches: {', '.join(close)})" if close else ""
