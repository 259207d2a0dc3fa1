"""bench/learn_vs_trl.py: its environment classes meet both trainers' contracts.

Its whole plumbing (warm start, budgeted runs of both trainers, saves, evals, the table) runs
for minutes even on a tiny model, past what the suite's budget has room for: the measured run
in docs/measurements.md exercises it.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import pytest

from environments import Chain, Counter
from environments.contract import check_environment, tool_names
from tests.support.paths import REPO

BENCH = REPO / "bench" / "learn_vs_trl.py"


@functools.cache
def _bench_module():
    spec = importlib.util.spec_from_file_location("learn_vs_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _trl_tools(cls: type) -> list[str]:
    """The tools TRL 1.16's `environment_factory` finds: public functions but reset, get_reward."""
    return sorted(
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    )


@pytest.mark.parametrize("base", [Counter, Chain])
def test_both_trainers_see_the_environments_own_tools_in_its_trl_contract_class(base):
    adapted = _bench_module().trl_contract(base)
    check_environment(adapted)
    assert _trl_tools(adapted) == tool_names(adapted) == tool_names(base)
    assert "reward" not in _trl_tools(adapted)


def test_the_trl_contract_class_takes_a_whole_row_and_scores_itself():
    counter = _bench_module().trl_contract(Counter)()
    assert counter.reset(prompt=[{"role": "user", "content": "x"}], target=3) is None
    counter.increment(2)
    assert counter.get_reward() == 0.0
    counter.increment(1)
    assert counter.get_reward() == 1.0
