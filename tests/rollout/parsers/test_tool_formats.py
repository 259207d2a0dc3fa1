"""The parsers of the formats beyond Hermes and Llama 3: XML (Qwen3.5+, GLM-4, ATEM), harmony,
Mistral. Each reads well-formed calls, types untyped values by the tool schema, and turns every
malformed call into one readable error without raising."""

from __future__ import annotations

import pytest

from rollout.parsers import get_parser
from rollout.parsers.common import MAX_JSON_DEPTH
from rollout.types import ParsedTurn, ToolCall

SCHEMA = {
    "type": "object",
    "properties": {
        "step": {"type": "integer"},
        "note": {"type": "string"},
        "exact": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "maybe": {"type": ["number", "null"]},
    },
}
TOOLS = [{"type": "function", "function": {"name": "record", "parameters": SCHEMA}}]


def qwen3_xml(name: str, **values: str) -> str:
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def glm4(name: str, **values: str) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def atem(name: str, **values: str) -> str:
    parameters = "".join(
        f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in values.items()
    )
    invoke = f'<atem:invoke name="{name}">\n{parameters}</atem:invoke>'
    return f" to={name}<|message|><atem:function_calls>\n{invoke}\n</atem:function_calls>"


XML_FORMATS = {"qwen3_xml": qwen3_xml, "glm4": glm4, "atem": atem}


@pytest.mark.parametrize("parser", sorted(XML_FORMATS))
def test_xml_values_are_typed_by_the_tool_schema(parser):
    write = XML_FORMATS[parser]
    text = write("record", step="3", note="42", exact="true", tags='["a b", "c"]', maybe="null")
    turn = get_parser(parser, tools=TOOLS)(text)
    assert turn == ParsedTurn(
        content="",
        tool_calls=[
            ToolCall(
                "record",
                {"step": 3, "note": "42", "exact": True, "tags": ["a b", "c"], "maybe": None},
            )
        ],
    )


@pytest.mark.parametrize("parser", sorted(XML_FORMATS))
def test_xml_values_stay_text_without_a_schema_or_when_they_do_not_fit_it(parser):
    write = XML_FORMATS[parser]
    untyped = get_parser(parser)(write("record", step="3"))
    assert untyped.tool_calls == [ToolCall("record", {"step": "3"})]
    wrong = get_parser(parser, tools=TOOLS)(write("record", step="three", exact="True"))
    assert wrong.tool_calls == [ToolCall("record", {"step": "three", "exact": True})]


@pytest.mark.parametrize("parser", sorted(XML_FORMATS))
def test_a_bad_xml_call_is_one_error_and_the_next_call_is_read(parser):
    write = XML_FORMATS[parser]
    bad = write("record", step="1", **{"step ": "2"}).replace("step ", "step")  # a key twice
    turn = get_parser(parser, tools=TOOLS)(bad + "\n" + write("record", step="5"))
    assert turn.tool_calls == [ToolCall("record", {"step": 5})]
    [error] = turn.errors
    assert error.startswith("Error: could not parse tool call: the argument")
    assert "is given twice" in error


@pytest.mark.parametrize("parser", sorted(XML_FORMATS))
def test_an_xml_call_left_open_is_an_error(parser):
    text = XML_FORMATS[parser]("record", step="1")
    turn = get_parser(parser)(text[: text.rindex("</")])
    assert turn.tool_calls == []
    assert len(turn.errors) == 1


@pytest.mark.parametrize("parser", sorted(XML_FORMATS))
def test_xml_values_past_the_json_limits_are_errors_not_exceptions(parser):
    write = XML_FORMATS[parser]
    deep = "[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5)
    for value in (deep, "7" * 5000):
        turn = get_parser(parser, tools=TOOLS)(write("record", tags=value, step=value))
        assert turn.tool_calls == []
        assert len(turn.errors) == 1


def test_qwen3_xml_keeps_the_text_outside_the_calls_as_content():
    turn = get_parser("qwen3_xml")("<think>\nhm\n</think>\n\n" + qwen3_xml("record", note="a"))
    assert turn.content == "<think>\nhm\n</think>"
    assert turn.tool_calls == [ToolCall("record", {"note": "a"})]


def test_qwen3_xml_text_where_a_parameter_belongs_is_an_error():
    turn = get_parser("qwen3_xml")(
        "<tool_call>\n<function=record>\nstep=3\n</function>\n</tool_call>"
    )
    assert turn.errors == [
        "Error: could not parse tool call: expected <parameter=KEY>...</parameter>, "
        'found "step=3". '
        "Write tool calls as <tool_call>\n<function=<tool name>>\n<parameter=<argument name>>\n"
        "<value>\n</parameter>\n</function>\n</tool_call>."
    ]


def test_glm4_needs_a_tool_name():
    turn = get_parser("glm4")(
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    )
    assert turn.tool_calls == []
    assert 'Error: could not parse tool call: "" is not a tool name.' in turn.errors[0]


def test_atem_drops_reasoning_and_reads_the_answer_to_the_user():
    parse = get_parser("atem")
    text = " to=self<|message|>Thinking.<|eom|><|start|>assistant to=user<|message|>It is 6."
    assert parse(text) == ParsedTurn(content="It is 6.")
    assert parse("plain words") == ParsedTurn(content="plain words")


# harmony (gpt-oss)

parse_harmony = get_parser("harmony")


def test_a_harmony_call_as_gpt_oss_renders_it_is_parsed():
    text = ' to=functions.record<|channel|>commentary json<|message|>{"step": 3, "note": "42"}'
    assert parse_harmony(text) == ParsedTurn(
        content="", tool_calls=[ToolCall("record", {"step": 3, "note": "42"})]
    )


def test_a_harmony_call_with_the_recipient_in_the_channel_is_parsed_after_its_reasoning():
    text = (
        "<|channel|>analysis<|message|>Need a tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.record <|constrain|>json<|message|>{"step": 1}'
    )
    turn = parse_harmony(text)
    assert turn.tool_calls == [ToolCall("record", {"step": 1})]
    assert turn.content == "Need a tool."


def test_the_final_channel_is_the_harmony_content():
    text = "<|channel|>analysis<|message|>Sum.<|end|><|start|>assistant<|channel|>final<|message|>6"
    assert parse_harmony(text) == ParsedTurn(content="6")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"step": 1', "Expecting ',' delimiter"),
        ("[1]", "the arguments of 'record' must be a JSON object, got array"),
        ('{"a": "\\ud800"}', "lone surrogate"),
        ("7" * 5000, "an integer has 5000 digits"),
    ],
)
def test_a_bad_harmony_call_is_an_error(body, reason):
    turn = parse_harmony(f" to=functions.record<|channel|>commentary json<|message|>{body}")
    assert turn.tool_calls == []
    [error] = turn.errors
    assert reason in error
    assert "<|call|>" in error  # the hint shows the format


# Mistral


parse_mistral = get_parser("mistral")


def test_mistral_json_array_calls_are_parsed():
    text = (
        'Sure.[TOOL_CALLS][{"name": "record", "arguments": {"step": 1}, "id": "a1b2c3d4e"}, '
        '{"name": "record", "arguments": {"step": 2}}]'
    )
    assert parse_mistral(text) == ParsedTurn(
        content="Sure.",
        tool_calls=[ToolCall("record", {"step": 1}), ToolCall("record", {"step": 2})],
    )


def test_mistral_name_and_args_calls_are_parsed():
    text = (
        '[TOOL_CALLS]record[ARGS]{"step": 1}[TOOL_CALLS]record[CALL_ID]abc123def[ARGS]{"step": 2}'
    )
    assert parse_mistral(text).tool_calls == [
        ToolCall("record", {"step": 1}),
        ToolCall("record", {"step": 2}),
    ]


def test_a_bad_mistral_call_is_an_error_and_the_others_are_read():
    text = (
        '[TOOL_CALLS][{"name": "record", "arguments": [1]}, {"name": "record"}]'
        '[TOOL_CALLS]record{"step": 3}[TOOL_CALLS]record[ARGS]{"step": 4'
    )
    turn = parse_mistral(text)
    assert turn.tool_calls == [ToolCall("record", {})]
    assert len(turn.errors) == 3
    assert "must be a JSON object, got array" in turn.errors[0]
    assert "expected [ARGS] after the tool name" in turn.errors[1]
    assert all("[TOOL_CALLS]" in error for error in turn.errors)


def test_mistral_text_without_the_marker_is_content():
    assert parse_mistral("  Just an answer. ") == ParsedTurn(content="Just an answer.")
