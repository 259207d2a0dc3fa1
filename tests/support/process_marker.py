"""The `process` marker, kept true: a test that starts a process without it fails.

`python -m pytest -m "not process"` runs the tests that stay inside pytest's process, a few
minutes in all. For that to hold, every test that starts a child process (a command line run, an
`accelerate launch`, a vLLM server, a sandbox child...), in its own body or in a fixture it sets
up, carries `@pytest.mark.process` (or its module's `pytestmark`). This plugin counts the
processes each test starts while it is set up and run, and turns an unmarked test that started
one into a failure naming the fix. A module- or session-scoped fixture starts its process in the
first test that uses it, so its module is marked whole.
"""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

MARKER = "process"
# Programs libraries run once per process to probe the machine (ctypes' library search, a
# compiler's version, the CPU's layout): whichever test comes first in a worker would start
# them, so they are not counted.
INCIDENTAL = {"ldconfig", "file", "lscpu", "uname", "git", "gcc", "g++", "cc", "c++"}
# Doctests cannot carry a marker: these start a process (answers are compared in a child
# process, which a time limit can kill, started by whichever comparison comes first).
DOCTESTS = {"agentgrpo.rewards.builtin.accuracy_reward", "agentgrpo.rewards.builtin.answers_match"}
_started: list[str] = []  # the commands of the processes started in this pytest process
_first = pytest.StashKey[int]()  # a test's index into `_started` when its set-up began


def _counting(start: Callable[..., Any], name: Callable[..., str]) -> Callable[..., Any]:
    """`start`, recording `name(*its arguments)` in `_started` each time it is called."""

    @functools.wraps(start)
    def counted(*args: Any, **kwargs: Any) -> Any:
        command = name(*args, **kwargs)
        if os.path.basename(command.split(" ", 1)[0]) not in INCIDENTAL:
            _started.append(command)
        return start(*args, **kwargs)

    return counted


def _command(popen: subprocess.Popen, args: Any, *_: Any, **__: Any) -> str:
    """The command line a `Popen(args, ...)` runs, cut to 200 characters."""
    return str(args if isinstance(args, str) else " ".join(map(str, args)))[:200]


def pytest_configure(config: pytest.Config) -> None:
    """Count every `subprocess.Popen` and `multiprocessing` process this pytest process starts."""
    subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__, _command)  # type: ignore[method-assign]
    base = multiprocessing.process.BaseProcess
    base.start = _counting(base.start, lambda process: f"multiprocessing {process.name}")  # type: ignore[method-assign]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the doctests of DOCTESTS, which cannot be marked where they are written."""
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.name in DOCTESTS:
            item.add_marker(MARKER)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    item.stash[_first] = len(_started)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or item.get_closest_marker(MARKER) is not None:
        return
    started = _started[item.stash.get(_first, len(_started)) :]
    if started and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"this test started {len(started)} process(es) ({started[0]}) without "
            f"@pytest.mark.{MARKER}: mark it (or its module, when a module-scoped fixture "
            'starts them), so that `-m "not process"` leaves it out'
        )
