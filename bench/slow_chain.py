"""`env:Chain` whose calculator tools take about 1 s each: a workload where tools dominate.

Used by `bench/async_vs_sync.py` as `bench/slow_chain.py:SlowChain`. The tools keep Chain's
signatures and docstrings, so the model is shown exactly Chain's tools.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from environments import Chain

TOOL_SECONDS = 1.0


def _slow(method: Callable[..., str]) -> Callable[..., str]:
    """`method`, after sleeping `TOOL_SECONDS` (a tool waiting on I/O)."""

    @functools.wraps(method)
    def slow(self: Any, *args: Any, **kwargs: Any) -> str:
        time.sleep(TOOL_SECONDS)
        return method(self, *args, **kwargs)

    return slow


class SlowChain(Chain):
    """Chain, with `add`, `subtract` and `multiply` each taking `TOOL_SECONDS` longer."""

    add = _slow(Chain.add)
    subtract = _slow(Chain.subtract)
    multiply = _slow(Chain.multiply)


def slow_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """0, 1, 2, ... per group, after `TOOL_SECONDS`: a reward that waits on I/O (a judge, say).

    With the tiny random model (which never calls a tool) it gives the run a slow, I/O-bound
    stage, and every group distinct rewards, so each step moves the weights.
    """
    time.sleep(TOOL_SECONDS)
    return [float(k) for k in range(len(completions))]
