"""The suite's venv helper gives a new venv this environment's packages, wherever the suite runs."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.paths import REPO
from tests.support.venvs import make_venv, site_folders

IMPORTS = "import anyio, agentgrpo_probe"
# Run inside an outer venv: the helper there, and venv's own --system-site-packages beside it.
NESTED = f"""
import subprocess, sys
from pathlib import Path
from tests.support.venvs import make_venv
assert sys.prefix != sys.base_prefix, "not inside a venv"
inner = make_venv(Path(sys.argv[1]) / "inner")
print(subprocess.run([inner, "-c", "{IMPORTS}"]).returncode)
subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                sys.argv[1] + "/system"], check=True)
print(subprocess.run([sys.argv[1] + "/system/bin/python", "-c", "{IMPORTS}"]).returncode)
"""


@pytest.mark.process
def test_a_venv_made_inside_a_venv_imports_the_outer_venvs_packages(tmp_path):
    # The outer venv sees a package only it has (agentgrpo_probe), as a developer's venv would.
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "agentgrpo_probe.py").write_text("")
    outer = make_venv(tmp_path / "outer")
    (site_folders(str(outer))[0] / "probe.pth").write_text(f"{probe}\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [outer, "-c", NESTED, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    # The helper's venv imports it; `--system-site-packages` from the venv does not (the cause).
    assert done.stdout.split() == ["0", "1"], done.stdout + done.stderr
