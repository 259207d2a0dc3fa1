"""Fuzzing: whatever the model writes, every parser and every episode returns data.

Inputs are arbitrary text and arbitrary JSON, with the shapes that broke runs before mixed in:
nesting deeper than Python's recursion limit, integers too long to convert, lone surrogate
escapes, odd Unicode, `NaN` / `Infinity`. Examples are derandomized and the database is off, so
a run is the same every time and takes seconds.
"""

from __future__ import annotations

import json

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from environments import Counter
from rollout import EpisodeConfig, Finish, RolloutEngine
from rollout.parsers import get_parser, parse_hermes, parse_llama3_json, tokenizer_parser
from rollout.text_encoding import max_token_chars
from tests.support.episodes import COUNTER_ROW, scripted_backend, single_row
from tests.support.fuzz import FUZZ, assert_is_data, json_values, odd_text, raw_json
from tests.support.parsing import HERMES_RESPONSE_TEMPLATE, offline_tokenizer

PARSERS = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "tokenizer": tokenizer_parser(offline_tokenizer(HERMES_RESPONSE_TEMPLATE)),
    **{name: get_parser(name, tools=[]) for name in ("qwen3_xml", "glm4", "atem")},
    **{name: get_parser(name) for name in ("harmony", "mistral")},
}
TOOL_NAMES = ["echo", "keep", "increment", "nope"]

arguments_json = st.one_of(
    st.dictionaries(st.sampled_from(["text", "value", "step", "x"]), raw_json, max_size=3).map(
        lambda items: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in items.items()) + "}"
    ),
    raw_json,
    raw_json.map(json.dumps),  # arguments as a JSON string, OpenAI style
)
name_json = st.sampled_from(TOOL_NAMES).map(json.dumps) | raw_json


@st.composite
def hermes_turns(draw) -> str:
    """Text with Hermes blocks in it: some well formed, some not, some left open."""
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        parts.append(draw(odd_text))
        call = f'{{"name": {draw(name_json)}, "arguments": {draw(arguments_json)}}}'
        parts.append(f"<tool_call>{draw(st.sampled_from([call, draw(raw_json)]))}")
        parts.append(draw(st.sampled_from(["</tool_call>", "", "</tool_call>\n"])))
    return "".join(parts) + draw(odd_text)


@st.composite
def llama3_turns(draw) -> str:
    """Llama 3 JSON calls separated by `;` or newlines, possibly broken, after optional tags."""
    calls = [
        draw(
            st.sampled_from(
                [
                    f'{{"name": {draw(name_json)}, "parameters": {draw(arguments_json)}}}',
                    draw(raw_json),
                ]
            )
        )
        for _ in range(draw(st.integers(1, 3)))
    ]
    separator = draw(st.sampled_from([";", "\n", "; ", ""]))
    prefix = draw(st.sampled_from(["", "<|python_tag|>", " "]))
    return prefix + separator.join(calls) + draw(st.sampled_from(["", " done", draw(odd_text)]))


model_turns = st.one_of(hermes_turns(), llama3_turns(), odd_text)
# Calls a real tool's real argument: what reaches the tool, its result and the template.
real_calls = st.builds(
    lambda tool, raw: (
        f'<tool_call>{{"name": "{tool[0]}", "arguments": {{"{tool[1]}": {raw}}}}}</tool_call>'
    ),
    st.sampled_from([("echo", "text"), ("keep", "value"), ("increment", "step")]),
    raw_json | json_values.map(lambda value: json.dumps({"nested": value})),
)


@FUZZ
@given(text=model_turns)
def test_every_parser_reads_any_text_as_data(text):
    for parser in PARSERS.values():
        assert_is_data(parser(text))


def keep(value: dict) -> dict:
    """Return the object unchanged.

    Args:
        value: Any JSON object.

    """
    return value


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: Any text.

    """
    return text


@pytest.fixture(scope="module")
def fuzzed_engine(tokenizer):
    """A Counter engine with plain tools, whose model says `script[0]`, then "Done."."""
    script = ["", "Done."]
    engine = RolloutEngine(
        scripted_backend(tokenizer, script),
        tokenizer,
        environment_factory=Counter,
        tools=[echo, keep],
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=8192, max_turns=3),
    )
    return engine, script


@FUZZ
@given(text=real_calls | model_turns)
def test_an_episode_ends_with_a_finish_whatever_the_model_writes(fuzzed_engine, text):
    engine, script = fuzzed_engine
    script[0] = text
    [episode] = anyio.run(engine.run, [COUNTER_ROW])
    assert isinstance(episode.finish, Finish)
    assert episode.error is None
    assert (
        len(single_row(episode).completion_ids)
        == len(single_row(episode).loss_mask)
        == len(single_row(episode).sampler_logprobs)
    )
    json.dumps(episode.messages, ensure_ascii=False).encode("utf-8")  # can be saved as is


# Long runs of a few characters: whitespace runs are what one token covers most of.
repeated_text = st.builds(
    lambda piece, times, tail: piece * times + tail,
    st.text(st.sampled_from(" \n=-a") | st.characters(), min_size=1, max_size=6),
    st.integers(1, 400),
    st.text(max_size=6),
)


@pytest.fixture(scope="module")
def token_chars(tokenizer) -> int:
    return max_token_chars(tokenizer)


@FUZZ
@given(text=repeated_text, budget_tokens=st.integers(0, 16))
def test_a_tool_text_is_cut_only_where_it_could_not_have_fit(
    tokenizer, token_chars, text, budget_tokens
):
    if len(text) >= budget_tokens * token_chars:
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= budget_tokens
