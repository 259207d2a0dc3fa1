"""`agentgrpo init` writes an environment package; installed, `run NAME` and `envs` find it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentgrpo.cli import main, sources
from agentgrpo.cli.envs_command import installed_listing
from environments import BUILTIN_ENVIRONMENTS
from tests.support.paths import REPO

SUMS = '''
class Sums:
    """Add numbers, one call at a time."""

    def reset(self, a: int) -> str:
        return f"Start at {a}."
'''


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Word-Games", "takes NAME as lowercase letters, digits and _"),
        ("2words", "starting with a letter"),
        ("lambda", "not a Python keyword"),
        ("json", "a module named 'json' is already importable"),
        ("environments", "a package of that name would shadow it or be shadowed"),
    ],
)
def test_init_refuses_a_name_that_cannot_be_a_package_of_its_own(user_error, name, expected):
    assert expected in user_error("init", name)


def test_init_refuses_a_folder_that_is_there_and_not_empty(user_error, tmp_path):
    (tmp_path / "word_games").mkdir()
    (tmp_path / "word_games" / "notes.txt").write_text("mine")
    message = user_error("init", "word_games", "--dir", str(tmp_path))
    assert f"{tmp_path / 'word_games'} already exists and is not an empty folder" in message
    assert (tmp_path / "word_games" / "notes.txt").read_text() == "mine"


def test_init_writes_into_an_empty_folder(tmp_path, capsys):
    (tmp_path / "word_games").mkdir()
    assert main(["init", "word_games", "--dir", str(tmp_path)]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*"))
    assert written == [
        "word_games/README.md",
        "word_games/pyproject.toml",
        "word_games/src/word_games/__init__.py",
        "word_games/src/word_games/env.py",
        "word_games/tests/test_env.py",
    ]
    pyproject = (tmp_path / "word_games" / "pyproject.toml").read_text()
    assert '[project.entry-points."agentgrpo.environments"]' in pyproject
    assert 'word_games = "word_games.env:WordGames"' in pyproject
    assert "agentgrpo run word_games" in capsys.readouterr().out


def test_envs_lists_each_installed_environment_or_why_its_name_fails(site):
    site.install("sums-pkg", "1.2", {"sums": "sums_env:Sums"}, {"sums_env": SUMS})
    site.install("shadow", "0.3", {"Counter": "sums_env:Sums"}, {})
    site.install("broken", "0.1", {"broken": "no_such_module_here:Env"}, {})
    lines = installed_listing(BUILTIN_ENVIRONMENTS).splitlines()
    assert lines[0] == "installed environment packages (agentgrpo run NAME):"
    rows = {line.split()[0]: line.split(maxsplit=4)[1:] for line in lines[1:]}
    assert rows["sums"] == ["sums_env:Sums", "sums-pkg", "1.2", "Add numbers, one call at a time."]
    assert rows["Counter"][-1] == (
        "refused as NAME: also the built-in env:Counter; use sums_env:Sums"
    )
    assert rows["broken"][-1] == "does not load: `agentgrpo doctor broken` says why"


def test_run_and_eval_play_an_installed_environment_by_its_name(site):
    site.install("sums-pkg", "1.2", {"sums": "sums_env:Sums"}, {"sums_env": SUMS})
    source = sources.task_source("sums")
    assert source.__name__ == "Sums" and sources.source_name(source) == "Sums"


def test_envs_says_how_to_make_one_when_none_is_installed():
    assert "none (`agentgrpo init NAME` writes one" in installed_listing(BUILTIN_ENVIRONMENTS)


def _python(*args: str, cwd: Path, site: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGS` with the throwaway install folder `site` first on its path."""
    path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": path},
    )


@pytest.mark.process
def test_an_initialised_package_installs_and_passes_its_own_tests_doctor_by_name_included(
    tmp_path,
):
    """The package's own tests run `check_environment`, and `agentgrpo doctor demo_env` in-process.

    docs/environment-sources.md's example lists such a package with `agentgrpo envs`.
    """
    assert main(["init", "demo_env", "--dir", str(tmp_path)]) == 0
    package, site = tmp_path / "demo_env", tmp_path / "site"
    install = ["-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    installed = _python(*install, "--target", str(site), str(package), cwd=tmp_path, site=site)
    assert installed.returncode == 0, installed.stderr
    assert (
        "demo_env = demo_env.env:DemoEnv"
        in next(site.glob("*.dist-info/entry_points.txt")).read_text()
    )

    tested = _python("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=package, site=site)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "4 passed" in tested.stdout
