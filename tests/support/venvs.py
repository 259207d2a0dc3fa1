"""Virtual environments for tests, made alike whether the suite runs in a venv, a conda env or not.

`python -m venv --system-site-packages` run from inside a venv sees the base interpreter's
packages, not the venv's, so a test that needs this environment's packages in a new venv adds
them itself: a `.pth` file that adds each of this interpreter's site folders, theirs processed too.
"""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

SITE_FOLDERS = "import json, site; print(json.dumps(site.getsitepackages()))"


def make_venv(folder: Path) -> Path:
    """A venv at `folder` (no pip) that imports what this interpreter imports; its interpreter."""
    command = [sys.executable, "-m", "venv", "--without-pip", str(folder)]
    subprocess.run(command, check=True, timeout=300)
    new_python = folder / "bin" / "python"
    lines = [f"import site; site.addsitedir({path!r})" for path in site.getsitepackages()]
    (site_folders(str(new_python))[0] / "agentgrpo-tests.pth").write_text("\n".join(lines) + "\n")
    return new_python


def site_folders(python: str) -> list[Path]:
    """The site-packages folders of the interpreter `python`, as `site` lists them."""
    done = subprocess.run(
        [python, "-c", SITE_FOLDERS], capture_output=True, text=True, check=True, timeout=120
    )
    return [Path(path) for path in json.loads(done.stdout)]
