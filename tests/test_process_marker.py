"""The `process` marker's plugin (tests/support/process_marker.py) fails what it should."""

from __future__ import annotations

import pytest

from tests.support.paths import REPO

INNER_TESTS = """
import subprocess, sys
import pytest

def start_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_starts_one():
    start_python()

@pytest.mark.process
def test_marked_starts_one():
    start_python()

def test_stays_in_process():
    assert sum([1, 2]) == 3

def test_probes_the_machine_as_libraries_do():
    subprocess.run(["uname", "-m"], check=True, capture_output=True)
"""


@pytest.mark.process
def test_a_test_that_starts_a_process_unmarked_fails_naming_the_marker(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest('pytest_plugins = ["tests.support.process_marker"]\n')
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked_starts_one*", "*started 1 process(es)*"])
    assert "without @pytest.mark.process" in result.stdout.str()
    assert "test_marked_starts_one" not in "".join(
        line for line in result.stdout.lines if line.startswith("FAILED")
    )
