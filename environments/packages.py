"""Environment packages: installed distributions that offer environments by name.

A package declares its environments in its metadata, as entry points of the group
``agentgrpo.environments``, each a name and the ``module:Class`` it stands for:

.. code-block:: toml

    [project.entry-points."agentgrpo.environments"]
    word_games = "word_games.env:WordGames"

Once the package is installed (``pip install``, or a folder on ``sys.path`` holding its
``.dist-info``), a spec without ``:`` is looked up among these names, so ``agentgrpo run
word_games`` plays ``word_games.env:WordGames``. ``agentgrpo init NAME`` writes such a package.

A name is found only when exactly one installed package declares it, and it is not a built-in's
name (``Counter``): a clash is an error naming both sides and the explicit spec of each
(``env:Counter``, ``word_games.env:Counter``), so which class plays never depends on what else
happens to be installed. The metadata is read on every lookup (no cache): a package installed
while Python runs is found.
"""

from __future__ import annotations

import difflib
import importlib.metadata
from collections.abc import Collection
from dataclasses import dataclass

from environments.errors import EnvironmentSpecError

ENTRY_POINT_GROUP = "agentgrpo.environments"
"""The entry point group an environment package declares its environments in."""


@dataclass(frozen=True)
class EnvironmentPackage:
    """One environment an installed package declares.

    Attributes:
        name: The entry point's name: what ``agentgrpo run NAME`` takes.
        target: What it stands for, ``module:Class`` (a spec `resolve_environment` also takes).
        package: The declaring distribution's name, as installed.
        version: That distribution's version.

    """

    name: str
    target: str
    package: str
    version: str

    @property
    def origin(self) -> str:
        """``package version``, for messages and listings."""
        return f"{self.package} {self.version}"

    def load(self) -> object:
        """Import the module and return the object `target` names (not checked to be a class).

        Raises:
            EnvironmentSpecError: Importing or looking it up raised; the message names the
                package, the target and the error.

        """
        try:
            return _entry_point(self).load()
        except Exception as error:
            raise EnvironmentSpecError(
                f"environment {self.name!r} of package {self.origin} points at "
                f"{self.target!r}, and loading it raised {type(error).__name__}: {error}; fix "
                f"the package (or its entry point in pyproject.toml) and reinstall it"
            ) from error


def installed_environments() -> list[EnvironmentPackage]:
    """Every environment the installed packages declare, sorted by name then package.

    A name two packages declare appears twice; `installed_environment` refuses it.
    """
    found = [
        EnvironmentPackage(
            name=entry.name,
            target=entry.value,
            package=entry.dist.name if entry.dist is not None else "(unknown package)",
            version=entry.dist.version if entry.dist is not None else "?",
        )
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    ]
    return sorted(found, key=lambda e: (e.name, e.package))


def installed_environment(name: str, builtins: Collection[str]) -> EnvironmentPackage:
    """The one installed environment called `name` (the spec had no ``:``).

    Args:
        name: The spec as typed.
        builtins: The built-in environments' names, which no package may take.

    Raises:
        EnvironmentSpecError: No package declares `name` (the message lists those that are
            installed, suggests the nearest, and says how to name a built-in or a class), or
            two packages do, or a package declares a built-in's name.

    """
    installed = installed_environments()
    matches = [entry for entry in installed if entry.name == name]
    if name in builtins and matches:
        others = ", ".join(f"{e.origin} ({e.target})" for e in matches)
        raise EnvironmentSpecError(
            f"environment {name!r} is both the built-in env:{name} and an environment of "
            f"package {others}; name the one you mean: 'env:{name}' or '{matches[0].target}'"
        )
    if len(matches) > 1:
        declared = "; ".join(f"{e.origin} as {e.target!r}" for e in matches)
        raise EnvironmentSpecError(
            f"environment {name!r} is declared by {len(matches)} installed packages "
            f"({declared}); name the class you mean as 'module:Class', or uninstall one"
        )
    if not matches:
        raise EnvironmentSpecError(_not_installed(name, installed, builtins))
    return matches[0]


def _not_installed(
    name: str, installed: list[EnvironmentPackage], builtins: Collection[str]
) -> str:
    """Why bare `name` names nothing, and what the user may have meant."""
    names = sorted({entry.name for entry in installed})
    hints = [f"env:{b}" for b in builtins if b.lower() == name.lower()]
    hints += difflib.get_close_matches(name, names, n=1)
    suggestion = f" (did you mean {hints[0]!r}?)" if hints else ""
    listing = (
        f"installed: {', '.join(names)}"
        if names
        else f"none is installed (a package declares one under the entry point group "
        f"{ENTRY_POINT_GROUP!r}; `agentgrpo init NAME` writes one)"
    )
    return (
        f"{name!r} is not an installed environment package{suggestion}; {listing}. Other specs "
        f"have a ':': 'env:Name' (a built-in), 'package.module:Class', 'path/to/file.py:Class'"
    )


def _entry_point(environment: EnvironmentPackage) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(
        name=environment.name, value=environment.target, group=ENTRY_POINT_GROUP
    )
