"""DeepSeek V3, Gemma 4 and LFM2 tool calls, read back from what the families' own templates write.

The templates are the originals TRL ships under `trl/chat_templates/`, read from the installed
package at test time (the tests skip without it); nothing of them is copied here. Templates of
these families that cannot show tool calls (Cohere, Gemma 1-3, Phi-3, the first LFM2, DeepSeek)
must be refused with `ToolTemplateError`.
"""

from __future__ import annotations

import json

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from environments import Counter
from rollout import EpisodeConfig, Finish, RolloutEngine, ScriptedBackend, ToolTemplateError
from rollout.parsers import detect_parser, get_parser, parse_deepseek_v3, parse_gemma4, parse_lfm2
from rollout.template import ChatRenderer
from rollout.types import ToolCall
from tests.support.episodes import COUNTER_ROW
from tests.support.fuzz import FUZZ, assert_is_data, odd_text, raw_json
from tests.support.parsing import offline_tokenizer, trl_template

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
# Values of every JSON type. No string holds ' or \: LFM2.5 templates write strings unescaped.
ADD_ARGUMENTS = {"a": 1, "text": 'hi "there"\nsecond line'}
ECHO_ARGUMENTS = {"nested": {"k": [1, 2.5, None, True]}, "flag": False, "ratio": -2.5, "none": None}
TWO_CALLS = [ToolCall("add", ADD_ARGUMENTS), ToolCall("echo", ECHO_ARGUMENTS)]

# Template -> the parser detected for it.
RENDERS_TOOL_CALLS = {
    **dict.fromkeys(
        ["gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5", "diffusion_gemma"], "gemma4"
    ),
    **dict.fromkeys(["lfm2_v2", "lfm2_2_5", "lfm2_2_5_v2"], "lfm2"),
    # DeepSeek templates write the calls but never the tool schemas (refused below).
    **dict.fromkeys(["deepseekv3", "deepseek_r1_distill"], "deepseek_v3"),
}
CANNOT_SHOW_TOOLS = [
    "cohere", "cohere2", "deepseekv3", "deepseek_r1_distill", "gemma", "gemma3", "lfm2", "phi3",
    "phi3_5",
]  # fmt: skip


def assistant_text(name: str) -> str:
    """What the template writes for an assistant turn holding TWO_CALLS (header included)."""
    deepseek = name.startswith("deepseek")
    calls = [
        {
            "type": "function",
            # DeepSeek's templates concatenate the arguments, so they must be a JSON string.
            "function": {
                "name": call.name,
                "arguments": json.dumps(call.arguments) if deepseek else call.arguments,
            },
        }
        for call in TWO_CALLS
    ]
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    # The R1 distill template shows tool calls only when content is None.
    turn = {"role": "assistant", "content": None if deepseek else "", "tool_calls": calls}
    renderer = ChatRenderer(offline_tokenizer(None), trl_template(name), [TOOL])
    before = renderer.render(prompt, generation_prompt=False)
    after = renderer.render([*prompt, turn], generation_prompt=False)
    assert after.startswith(before)
    return after[len(before) :]


@pytest.mark.parametrize("name", sorted(RENDERS_TOOL_CALLS))
def test_two_tool_calls_a_template_renders_are_read_back_by_the_detected_parser(name):
    parser_name = detect_parser(trl_template(name))
    assert parser_name == RENDERS_TOOL_CALLS[name]
    turn = get_parser(parser_name)(assistant_text(name))
    assert turn.tool_calls == TWO_CALLS
    assert turn.errors == []


@pytest.mark.parametrize("name", sorted(set(RENDERS_TOOL_CALLS) - set(CANNOT_SHOW_TOOLS)))
def test_a_template_that_shows_tools_calls_and_results_passes_the_support_check(name):
    ChatRenderer(offline_tokenizer(None), trl_template(name), [TOOL]).check_tool_support()


@pytest.mark.parametrize("name", CANNOT_SHOW_TOOLS)
def test_a_template_that_cannot_show_tool_calls_is_refused_with_a_clear_error(name):
    renderer = ChatRenderer(offline_tokenizer(None), trl_template(name), [TOOL])
    with pytest.raises(ToolTemplateError, match="chat_template='chatml_tools'"):
        renderer.check_tool_support()


def test_a_template_that_fails_on_dict_arguments_is_refused_naming_the_failure():
    renderer = ChatRenderer(offline_tokenizer(None), trl_template("deepseekv3"), [TOOL])
    with pytest.raises(ToolTemplateError, match=r"fails on a conversation .*TypeError"):
        renderer.check_tool_support()


DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
GEMMA_CALL = "<|tool_call>call:{}{}<tool_call|>"
LFM2_CALLS = "<|tool_call_start|>[{}]<|tool_call_end|>"


def test_a_deepseek_turn_keeps_its_text_outside_the_call_markers_as_content():
    calls = DS_CALL.format("add", '{"a": 1}') + "\n" + DS_CALL.format("sub", "{}")
    turn = parse_deepseek_v3(f"Let me add.<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>")
    assert turn.content == "Let me add."
    assert turn.tool_calls == [ToolCall("add", {"a": 1}), ToolCall("sub", {})]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (DS_CALL.format("add", '{"a": 1'), "Expecting ',' delimiter"),
        (DS_CALL.format("add", "[1]"), "must be a JSON object, got array"),
        (DS_CALL.format("", '{"a": 1}'), "no tool name"),
        ("<｜tool▁call▁begin｜>function add {}<｜tool▁call▁end｜>", "no <｜tool▁sep｜>"),
        (DS_CALL.format("add", '{"a": 1}').removesuffix("<｜tool▁call▁end｜>"), "turn ended"),
        (DS_CALL.format("add", "[" * 200 + "]" * 200), "nests deeper than 128"),
    ],
)
def test_a_malformed_deepseek_call_is_an_error_and_the_next_call_is_kept(text, reason):
    turn = parse_deepseek_v3(DS_CALL.format("ok", "{}") + text)
    assert turn.tool_calls == [ToolCall("ok", {})]
    [error] = turn.errors
    assert error.startswith("Error: could not parse tool call:") and reason in error
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜><tool name>" in error  # how to write it


def test_gemma4_values_are_typed_by_how_they_are_written():
    body = '{s:<|"|>7<|"|>,n:7,f:-0.5,b:true,z:null,old:None,l:[],<|"|>quoted key<|"|>:{}}'
    [call] = parse_gemma4(GEMMA_CALL.format("f", body)).tool_calls
    expected = {"s": "7", "n": 7, "f": -0.5, "b": True, "z": None, "old": None, "l": []}
    assert call.arguments == {**expected, "quoted key": {}}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (GEMMA_CALL.format("add", "{a:Paris}"), '"Paris" is not a value'),
        (GEMMA_CALL.format("add", '{a:<|"|>open}'), "never closed"),
        (GEMMA_CALL.format("add", "{a:1"), "expected ,"),
        (GEMMA_CALL.format("", "{a:1}"), "no tool name"),
        (GEMMA_CALL.format("add", ""), "expected { after the tool name 'add'"),
        ("<|tool_call>add{a:1}<tool_call|>", "expected call:"),
        (GEMMA_CALL.format("add", "{a:1}").removesuffix("<tool_call|>"), "turn ended"),
        (GEMMA_CALL.format("add", "{a:" + "[" * 200 + "]" * 200 + "}"), "nests deeper than 128"),
        (GEMMA_CALL.format("add", "{a:" + "7" * 5000 + "}"), "has 5000 digits"),
    ],
)
def test_a_malformed_gemma4_call_is_an_error_and_the_next_call_is_kept(text, reason):
    turn = parse_gemma4(GEMMA_CALL.format("ok", "{}") + text)
    assert turn.tool_calls == [ToolCall("ok", {})]
    [error] = turn.errors
    assert error.startswith("Error: could not parse tool call:") and reason in error
    assert "<|tool_call>call:<tool name>{<key>:<value>,...}<tool_call|>" in error


def test_lfm2_values_are_python_or_json_literals_and_never_run():
    text = "[f(s='7', n=-7, t=(1, 2), d={'a': None}, j={\"b\": [true, null]}, e=__import__)]"
    turn = parse_lfm2(LFM2_CALLS.format(text[1:-1]))
    assert turn.tool_calls == []
    assert '"__import__" is not a literal value' in turn.errors[0]
    [call] = parse_lfm2(LFM2_CALLS.format(text[1:-1].replace(", e=__import__", ""))).tool_calls
    assert call.arguments == {
        "s": "7",
        "n": -7,
        "t": [1, 2],
        "d": {"a": None},
        "j": {"b": [1, None]},
    }


def test_each_bad_call_in_an_lfm2_list_is_its_own_error_and_the_good_calls_are_kept():
    turn = parse_lfm2(LFM2_CALLS.format("ok(), add(1), ok(a=1, a=2), 'text', ok(x={1: 2})"))
    assert turn.tool_calls == [ToolCall("ok", {})]
    assert [error.split(". Write")[0].split(": ", 2)[2] for error in turn.errors] == [
        "the arguments of 'add' must each be given as <key>=<value>",
        "the argument 'a' of 'ok' is given twice",
        "\"'text'\" is not a call <tool name>(<key>=<value>, ...)",
        "the keys of an object must be strings",
    ]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (LFM2_CALLS.format("add(a=1"), "does not match opening parenthesis"),
        (LFM2_CALLS.format("add(a=1+1)"), '"1+1" is not a literal value'),
        (LFM2_CALLS.format("add(a=" + "7" * 5000 + ")"), "more than 4300 digits"),
        (LFM2_CALLS.format("add(a=" + "-" * 100_000 + "1)"), "nests too deep"),
        (LFM2_CALLS.format("add(a='\\ud800')"), "lone surrogate"),
        (LFM2_CALLS.format("add()").removesuffix("<|tool_call_end|>"), "turn ended"),
    ],
)
def test_a_malformed_lfm2_block_is_one_error_and_the_next_block_is_kept(text, reason):
    turn = parse_lfm2(LFM2_CALLS.format("ok()") + text)
    assert turn.tool_calls == [ToolCall("ok", {})]
    [error] = turn.errors
    assert error.startswith("Error: could not parse tool call:") and reason in error
    assert "<|tool_call_start|>[<tool name>(<key>=<value>, ...), ...]<|tool_call_end|>" in error


def test_a_line_break_an_lfm2_template_writes_inside_a_string_is_read_as_one():
    [call] = parse_lfm2(LFM2_CALLS.format('say(text=\'two\nlines\', other="a\\"b")')).tool_calls
    assert call.arguments == {"text": "two\nlines", "other": 'a"b'}


@pytest.mark.parametrize("parser", [parse_deepseek_v3, parse_gemma4, parse_lfm2])
def test_a_turn_without_tool_calls_is_all_content(parser):
    turn = parser("  The answer is 7 (see [f(x=1)] and {a:1}).\n")
    assert (turn.content, turn.tool_calls, turn.errors) == (
        "The answer is 7 (see [f(x=1)] and {a:1}).",
        [],
        [],
    )


def lfm2_backend(tokenizer, turns: list[str]) -> ScriptedBackend:
    """Answer turn k with turns[k], k the tool messages seen so far (LFM2's `tool` role)."""
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        k = tokenizer.decode(context).count("<|im_start|>tool")
        return tokenizer.encode(turns[min(k, len(turns) - 1)], add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos])


def test_an_lfm2_episode_detects_its_parser_and_runs_the_calls(tokenizer):
    # LFM2.5's template is ChatML, so SmolLM2's tokenizer ends its turns with <|im_end|>.
    turns = [
        LFM2_CALLS.format("increment(step=3), increment(step=4)"),
        "Done.",
    ]
    engine = RolloutEngine(
        lfm2_backend(tokenizer, turns),
        tokenizer,
        environment_factory=Counter,
        chat_template=trl_template("lfm2_2_5"),
        config=EpisodeConfig(max_completion_length=512, max_turns=4),
    )
    [episode] = anyio.run(engine.run, [COUNTER_ROW])
    assert episode.finish is Finish.STOP
    assert [(call.arguments, call.result) for call in episode.tool_calls] == [
        ({"step": 3}, "3"),
        ({"step": 4}, "7"),
    ]
    assert episode.env_reward == 1.0


@st.composite
def marked_turns(draw, tokens: list[str]) -> str:
    """Text made of a format's markers, JSON, Python-ish pieces and odd text, in any order."""
    pieces = st.sampled_from(tokens) | odd_text | raw_json
    return "".join(draw(st.lists(pieces, max_size=12)))


DEEPSEEK_TOKENS = [
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>", "add",
    "\n```json\n", "\n```", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", '{"a": 1}',
]  # fmt: skip
GEMMA_TOKENS = [
    "<|tool_call>", "call:", "add", "{", "}", "[", "]", ",", ":", '<|"|>', "true", "null",
    "None", "-1.5e3", "<tool_call|>",
]  # fmt: skip
LFM2_TOKENS = [
    "<|tool_call_start|>", "[", "]", "add(", ")", "a=", "=", ",", "'", '"', "\\", "\n", "-",
    "None", "true", "{", "}", "(", "**", "f'", "<|tool_call_end|>",
]  # fmt: skip


model_turns = st.one_of(
    marked_turns(DEEPSEEK_TOKENS), marked_turns(GEMMA_TOKENS), marked_turns(LFM2_TOKENS), odd_text
)


@FUZZ
@given(text=model_turns)
def test_every_new_parser_reads_any_text_as_data(text):
    for parser in (parse_deepseek_v3, parse_gemma4, parse_lfm2):
        assert_is_data(parser(text))
