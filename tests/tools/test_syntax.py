"""Parses on two threads at once: CPython's gh-106905 must not reach a tool or the parser.

The test makes the thread switch that a loaded machine makes by chance: a garbage collection
inside the calculator's parse runs a callback, which lets a second thread parse and waits for
it. Without the project's parse lock the first parse raised `SystemError: AST constructor
recursion depth mismatch` (CPython 3.11.7, gh-106905), which the model read as the tool's error.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator

import pytest

from rollout.parsers import parse_lfm2
from tools.calculator import calculator

EXPRESSION = "(854 + 923) * 407 + 340"
LFM2_TURN = (
    "<|tool_call_start|>[submit(answer=723579, note=[1, (2, 3), {'a': None}])]<|tool_call_end|>"
)


@pytest.fixture
def collect_often() -> Iterator[None]:
    """Run a collection at nearly every allocation, so that one lands inside a parse."""
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


def parse_while_another_thread_parses(parse: Callable[[], object]) -> object:
    """Run `calculator(EXPRESSION)`; a collection inside it lets `parse` run on another thread.

    Returns what `parse` returned, after both have finished.
    """
    first_thread, started, results = threading.get_ident(), threading.Event(), []
    second = threading.Thread(target=lambda: results.append(parse()))

    def switch_inside_the_parse(phase: str, info: dict) -> None:
        if threading.get_ident() == first_thread and parsing.is_set() and not started.is_set():
            started.set()
            second.start()
            second.join(timeout=0.5)  # a parse lock makes it wait; then the first goes on

    parsing = threading.Event()
    gc.callbacks.append(switch_inside_the_parse)
    try:
        parsing.set()
        assert calculator(EXPRESSION) == "723579"
        parsing.clear()
    finally:
        gc.callbacks.remove(switch_inside_the_parse)
    assert started.is_set(), "no collection ran inside the parse"
    second.join(timeout=30)
    assert not second.is_alive()
    return results[0]


def test_the_calculator_parses_while_another_calculator_parses(collect_often: None) -> None:
    assert parse_while_another_thread_parses(lambda: calculator("6 * 7")) == "42"


def test_the_calculator_parses_while_the_lfm2_parser_parses(collect_often: None) -> None:
    turn = parse_while_another_thread_parses(lambda: parse_lfm2(LFM2_TURN))
    [call] = turn.tool_calls
    assert call.arguments == {"answer": 723579, "note": [1, [2, 3], {"a": None}]}
