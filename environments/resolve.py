"""Turning an environment spec string, as typed on the command line, into a class.

Seven forms, told apart by the part before the last ``:`` (``gym:``, ``gem:`` and ``ta:`` by
the prefix alone):

- ``NAME`` (no ``:``): an environment an installed package declares (`environments.packages`);
- ``env:Name``: a built-in from `BUILTIN_ENVIRONMENTS`;
- ``gym:ENV_ID``: a registered gymnasium env with a text observation (a ``Text`` observation
  space or an ``ansi`` render mode), through the gymnasium adapter; ``gym:ENV_ID,key=value``
  passes arguments to ``gymnasium.make`` (see `environments.gym_ids`);
- ``gem:ENV_ID``: an environment of GEM's registry (`gem_environment`; needs gem-llm), such as
  ``gem:game:GuessTheNumber-v0-easy``;
- ``ta:GAME_ID``: a TextArena game (`textarena_environment`; needs textarena), such as
  ``ta:TicTacToe-v0,opponent=random``;
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

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

from environments.arithmetic import Arithmetic
from environments.chain import Chain
from environments.colour_square import ColourSquare
from environments.counter import Counter
from environments.errors import EnvironmentSpecError
from environments.gem_adapter import GEM_PREFIX, gem_environment
from environments.guess_number import GuessNumber
from environments.gym_ids import gym_id_environment
from environments.packages import installed_environment
from environments.questions import Questions
from environments.reasoning_gym_tasks import reasoning_gym_environment
from environments.textarena_adapter import TA_PREFIX, textarena_environment
from environments.trail import Trail

BUILTIN_ENVIRONMENTS: dict[str, type] = {
    "Counter": Counter,
    "Arithmetic": Arithmetic,
    "GuessNumber": GuessNumber,
    "Chain": Chain,
    "ColourSquare": ColourSquare,
    "Trail": Trail,
    "Questions": Questions,
}
"""The environments reachable as ``env:Name``."""

_NOT_IDENTIFIER = re.compile(r"\W")
_FORMS = (
    "'NAME' (an installed environment package), 'env:Name' (a built-in), 'gym:ENV_ID' (a "
    "gymnasium id), 'gem:ENV_ID' (GEM), 'ta:GAME_ID' (TextArena), 'rg:TASK' (reasoning-gym), "
    "'package.module:Class' or 'path/to/file.py:Class'"
)
GYM_PREFIX = "gym:"


def resolve_environment(spec: str) -> type:
    """Return the environment class a spec names.

    Only checks that the result is a class with a ``reset`` method; call `check_environment`
    for the full contract.

    Args:
        spec: ``NAME`` (an installed package's), ``env:Name``, ``gym:ENV_ID``, ``rg:TASK``,
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


def load_attribute(spec: str, kind: Callable[[object], bool] = callable) -> object:
    """Return what ``package.module:name`` or ``path/to/file.py:name`` names (any object).

    The same lookup as for environment classes, for other things a command line names, such as
    reward functions. ``name`` may be dotted. When it is missing, the error lists (and
    suggests among) the names there that pass `kind`.

    Raises:
        EnvironmentSpecError: The spec is malformed, or names something missing; the message
            suggests the nearest name where it can.

    """
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute:
        raise EnvironmentSpecError(
            f"{spec!r} needs the form 'package.module:name' or 'path/to/file.py:name'"
        )
    module, label = (
        (_load_file(where), f"file {where!r}")
        if where.endswith(".py") or "/" in where or os.sep in where
        else (_import(where), f"module {where!r}")
    )
    return _attribute(module, attribute, label, kind)


def _builtin(name: str) -> type:
    if name in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[name]
    raise EnvironmentSpecError(
        f"no built-in environment {name!r}{_suggest(name, BUILTIN_ENVIRONMENTS)}; built-ins: "
        f"{', '.join(sorted(BUILTIN_ENVIRONMENTS))} (for a file named env.py, use "
        f"'env.py:{name}')"
    )


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and (name == error.name or name.startswith(error.name + ".")):
            raise EnvironmentSpecError(
                f"cannot import module {name!r}: it is not on sys.path (current directory: "
                f"{Path.cwd()}); to load a file instead, write 'path/to/file.py:Class'"
            ) from error
        raise EnvironmentSpecError(f"importing module {name!r} failed: {error}") from error
    except Exception as error:
        raise EnvironmentSpecError(
            f"importing module {name!r} raised {type(error).__name__}: {error}"
        ) from error


def _load_file(where: str) -> ModuleType:
    path = (Path.cwd() / Path(where).expanduser()).resolve()
    if not path.is_file():
        raise EnvironmentSpecError(
            f"environment file not found: {path} (relative paths start at the current "
            f"directory, {Path.cwd()})"
        )
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"_agentgrpo_env_{_NOT_IDENTIFIER.sub('_', path.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise EnvironmentSpecError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # before running it: dataclasses and pickle look it up
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise EnvironmentSpecError(
            f"running environment file {path} raised {type(error).__name__}: {error}"
        ) from error
    return module


def _attribute(
    module: ModuleType, dotted: str, where: str, kind: Callable[[object], bool] = inspect.isclass
) -> object:
    """`module.dotted`; when missing, the error lists the names there that pass `kind`."""
    obj: object = module
    for part in dotted.split("."):
        if not hasattr(obj, part):
            names = sorted(
                name
                for name, value in getattr(obj, "__dict__", {}).items()
                if kind(value) and not name.startswith("_")
            )
            label = "classes" if kind is inspect.isclass else "names"
            listing = f"; {label} there: {', '.join(names)}" if names else ""
            raise EnvironmentSpecError(f"{where} has no {part!r}{_suggest(part, names)}{listing}")
        obj = getattr(obj, part)
    return obj


def _suggest(name: str, candidates: Iterable[str]) -> str:
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    close = difflib.get_close_matches(name.lower(), by_lower, n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""
