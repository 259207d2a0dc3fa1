"""The package as a wheel: CI's part of `bench/check_wheel.py` (the whole check installs torch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.process


def test_the_wheel_installs_with_its_data_and_its_command_starts_outside_the_checkout():
    # With the checkout on PYTHONPATH, as some developers run the suite: the check must still
    # import the installed wheel, not the checkout's files (and pip must install its script).
    environ = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "check_wheel.py"), "--quick"],
        capture_output=True, text=True, timeout=900, env=environ,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    passed = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(passed) >= 10 and done.stdout.endswith("\n0 failed\n"), done.stdout
