"""Loading what a spec string names: ``package.module:name`` or ``path/to/file.py:name``.

`load_attribute` is the lookup every spec shares (environment classes in
`environments.resolve`, an opponent function of ``ta:``, an OpenEnv class, a reward function on
the command line). A file runs once, as a module with a name of its own (so two files called
``env.py`` do not collide), with its folder first on ``sys.path``; a missing name is reported
with the names there and the nearest one (`suggest`).
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

from environments.errors import EnvironmentSpecError

_NOT_IDENTIFIER = re.compile(r"\W")


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
            raise EnvironmentSpecError(f"{where} has no {part!r}{suggest(part, names)}{listing}")
        obj = getattr(obj, part)
    return obj


def suggest(name: str, candidates: Iterable[str]) -> str:
    """`" (did you mean ...?)"` naming the candidate nearest `name`, or "" when none is near."""
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    close = difflib.get_close_matches(name.lower(), by_lower, n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""
