"""Turning an environment spec string, as typed on the command line, into a class.

Eight forms, told apart by the part before the last ``:`` (``gym:``, ``gem:``, ``ta:`` and
``openenv:`` by the prefix alone):

- ``NAME`` (no ``:``): an environment an installed package declares (`environments.packages`);
- ``env:Name``: a built-in from `BUILTIN_ENVIRONMENTS`;
- ``gym:ENV_ID``: a registered gymnasium env with a text observation (a ``Text`` observation
  space or an ``ansi`` render mode), through the gymnasium adapter; ``gym:ENV_ID,key=value``
  passes arguments to ``gymnasium.make`` (see `environments.gym_ids`);
- ``gem:ENV_ID``: an environment of GEM's registry (`gem_environment`; needs gem-llm), such as
  ``gem:game:GuessTheNumber-v0-easy``;
- ``ta:GAME_ID``: a TextArena game (`textarena_environment`; needs textarena), such as
  ``ta:GuessTheNumber-v0``; a game of two or more players is a game with seats
  (``ta:TicTacToe-v0``, ``ta:ThreePlayerTicTacToe-v0``) or, with ``opponent=`` (two players
  only), one the option plays a seat of (``ta:TicTacToe-v0,opponent=random``);
- ``openenv:module:Class`` or ``openenv:http://host:port``: an OpenEnv environment, in this
  process or served (`openenv_environment`; needs openenv-core), such as
  ``openenv:my_envs:Maze`` or ``openenv:http://127.0.0.1:8000``;
- ``rg:TASK``: a reasoning-gym task (`reasoning_gym_environment`; needs reasoning-gym);
- ``path/to/file.py:Class``: anything ending in ``.py`` or containing a path separator; a
  relative path starts at the current directory. The file runs once, as a module with a name of
  its own (so two files called ``env.py`` do not collide); resolving it again reuses it. Its
  folder goes first on ``sys.path``, as ``python file.py`` puts it, so it imports the modules
  beside it;
- ``package.module:Class``: imported with `importlib`, so the module must be on ``sys.path``.

``Class`` may be dotted (``module:Outer.Inner``). A built-in prefix (``env``, ``rg``) wins, so a
user's own ``env.py`` is reached as ``env.py:Class``.
"""

from __future__ import annotations

import inspect

from environments.arithmetic import Arithmetic
from environments.chain import Chain
from environments.colour_square import ColourSquare
from environments.counter import Counter
from environments.errors import EnvironmentSpecError
from environments.gem_adapter import GEM_PREFIX, gem_environment
from environments.guess_number import GuessNumber
from environments.gym_ids import gym_id_environment
from environments.loading import load_attribute, suggest
from environments.openenv_adapter import OPENENV_PREFIX, openenv_environment
from environments.packages import installed_environment
from environments.questions import Questions
from environments.reasoning_gym_tasks import reasoning_gym_environment
from environments.textarena_adapter import TA_PREFIX, textarena_environment
from environments.tictactoe import TicTacToe
from environments.trail import Trail

BUILTIN_ENVIRONMENTS: dict[str, type] = {
    "Counter": Counter,
    "Arithmetic": Arithmetic,
    "GuessNumber": GuessNumber,
    "Chain": Chain,
    "ColourSquare": ColourSquare,
    "Trail": Trail,
    "Questions": Questions,
    "TicTacToe": TicTacToe,
}
"""The environments reachable as ``env:Name``."""

_FORMS = (
    "'NAME' (an installed environment package), 'env:Name' (a built-in), 'gym:ENV_ID' (a "
    "gymnasium id), 'gem:ENV_ID' (GEM), 'ta:GAME_ID' (TextArena), 'openenv:module:Class' or "
    "'openenv:http://host:port' (OpenEnv), 'rg:TASK' (reasoning-gym), "
    "'package.module:Class' or 'path/to/file.py:Class'"
)
GYM_PREFIX = "gym:"


def resolve_environment(spec: str) -> type:
    """Return the environment class a spec names.

    Only checks that the result is a class with a ``reset`` method; call `check_environment`
    for the full contract.

    Args:
        spec: ``NAME`` (an installed package's), ``env:Name``, ``gym:ENV_ID``, ``gem:ENV_ID``,
            ``ta:GAME_ID``, ``openenv:module:Class``, ``openenv:http://host:port``, ``rg:TASK``,
            ``package.module:Class`` or ``path/to/file.py:Class``.

    Returns:
        The class (not an instance).

    Raises:
        EnvironmentSpecError: The spec is malformed, or names something missing or unusable;
            the message says which part and, where it can, suggests the nearest name.

    """
    if not isinstance(spec, str) or not spec:
        raise EnvironmentSpecError(f"environment spec {spec!r} is not a name; use {_FORMS}")
    if ":" not in spec:
        return _checked(spec, installed_environment(spec, BUILTIN_ENVIRONMENTS).load())
    if spec.startswith(GYM_PREFIX):  # before splitting: a gym id may hold a ':' of its own
        return gym_id_environment(spec.removeprefix(GYM_PREFIX))
    if spec.startswith(GEM_PREFIX):  # GEM's ids hold a ':' of their own (game:...)
        return gem_environment(spec.removeprefix(GEM_PREFIX))
    if spec.startswith(TA_PREFIX):  # an opponent=module:function holds a ':' of its own
        return textarena_environment(spec.removeprefix(TA_PREFIX))
    if spec.startswith(OPENENV_PREFIX):  # a module:Class or a URL holds ':' of its own
        return openenv_environment(spec.removeprefix(OPENENV_PREFIX))
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute:
        raise EnvironmentSpecError(
            f"environment spec {spec!r} needs text on both sides of ':'; use {_FORMS}"
        )
    match where:
        case "env":
            obj: object = _builtin(attribute)
        case "rg":
            obj = reasoning_gym_environment(attribute)
        case _:
            obj = load_attribute(spec, inspect.isclass)
    return _checked(spec, obj)


def _checked(spec: str, obj: object) -> type:
    """`obj`, which `spec` names, once it is a class with a ``reset`` method."""
    if not inspect.isclass(obj):
        raise EnvironmentSpecError(
            f"{spec!r} names a {type(obj).__name__}, not a class; an environment is a class "
            "with a reset() method"
        )
    if not callable(getattr(obj, "reset", None)):
        raise EnvironmentSpecError(
            f"{spec!r} names class {obj.__qualname__}, which has no reset() method; an "
            "environment needs `def reset(self, **row) -> str | None`"
        )
    return obj


def _builtin(name: str) -> type:
    if name in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[name]
    raise EnvironmentSpecError(
        f"no built-in environment {name!r}{suggest(name, BUILTIN_ENVIRONMENTS)}; built-ins: "
        f"{', '.join(sorted(BUILTIN_ENVIRONMENTS))} (for a file named env.py, use "
        f"'env.py:{name}')"
    )
