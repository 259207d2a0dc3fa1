"""Hypothesis strategies for what a model may write, and the check that a parse is data."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from rollout.types import ParsedTurn

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


odd_text = st.text(
    st.characters(codec=None) | st.sampled_from(["\n", " ", "\u200b", "\ufeff", "\u0301", "𝔸"]),
    max_size=12,
)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | odd_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(odd_text, children, max_size=4)
    ),
    max_leaves=8,
)


deep_json = st.integers(1, 1500).map(lambda depth: "[" * depth + "]" * depth)


huge_int = st.integers(4000, 6000).map(lambda digits: "-" * (digits % 2) + "7" * digits)


surrogate = st.integers(0xD800, 0xDFFF).map(lambda code: f'"a\\u{code:04x}b"')


non_finite = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0.0", "1E+400"])


raw_json = st.one_of(
    json_values.map(lambda value: json.dumps(value, ensure_ascii=False)),
    json_values.map(json.dumps),
    deep_json,
    huge_int,
    surrogate,
    non_finite,
    odd_text,
)


def assert_is_data(turn: ParsedTurn) -> None:
    """A parsed turn a later stage can render, tokenize and save."""
    assert isinstance(turn, ParsedTurn)
    assert isinstance(turn.content, str)
    for error in turn.errors:
        error.encode("utf-8")
    for call in turn.tool_calls:
        assert isinstance(call.name, str)
        assert isinstance(call.arguments, dict)
        json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False).encode()
