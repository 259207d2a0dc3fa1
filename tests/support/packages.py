"""Installed environment packages for tests, written as pip writes them, onto a test's sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


class Site:
    """A folder on `sys.path` (for one test) that packages are installed into.

    `install` writes what `importlib.metadata` reads of an installed distribution (its
    ``.dist-info`` folder with ``METADATA`` and ``entry_points.txt``) and the package's modules,
    so the lookup under test reads real metadata from disk. The modules imported from it are
    forgotten when the test ends.
    """

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder = folder
        self.modules: list[str] = []
        folder.mkdir()
        monkeypatch.syspath_prepend(str(folder))

    def install(
        self, package: str, version: str, environments: dict[str, str], modules: dict[str, str]
    ) -> None:
        """Install `package` declaring `environments` (name -> ``module:Class``) and `modules`.

        Args:
            package: The distribution's name.
            version: Its version.
            environments: Its ``agentgrpo.environments`` entry points.
            modules: Module name -> source, written as top-level ``.py`` files.

        """
        info = self.folder / f"{package.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
        )
        lines = [f"{name} = {target}" for name, target in environments.items()]
        (info / "entry_points.txt").write_text("[agentgrpo.environments]\n" + "\n".join(lines))
        for module, source in modules.items():
            (self.folder / f"{module}.py").write_text(source)
            self.modules.append(module)

    def forget(self) -> None:
        """Drop the modules imported from this site, so no later test sees them."""
        for module in self.modules:
            sys.modules.pop(module, None)
