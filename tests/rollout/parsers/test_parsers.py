from __future__ import annotations

import pytest

from rollout.parsers import (
    PARSERS,
    _turn_from_message,
    detect_parser,
    get_parser,
    parse_hermes,
    parse_llama3_json,
    tokenizer_parser,
)
from rollout.types import ParsedTurn, ToolCall
from tests.support.parsing import HERMES_RESPONSE_TEMPLATE, offline_tokenizer


def hermes_block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
ECHO = '{"name": "echo", "arguments": {"text": "hi"}}'


# Hermes


def test_a_single_tool_call_is_parsed_with_its_arguments():
    turn = parse_hermes(hermes_block(ADD))
    assert turn == ParsedTurn(content="", tool_calls=[ToolCall("add", {"a": 1, "b": 2})])


def test_two_tool_calls_in_one_turn_are_both_parsed_in_order():
    turn = parse_hermes(hermes_block(ADD) + "\n" + hermes_block(ECHO))
    assert [call.name for call in turn.tool_calls] == ["add", "echo"]
    assert turn.errors == []


def test_text_around_tool_calls_becomes_the_stripped_content():
    text = f"Let me add.\n{hermes_block(ADD)}\nThen echo.{hermes_block(ECHO)}\n"
    turn = parse_hermes(text)
    assert turn.content == "Let me add.\n\nThen echo."
    assert len(turn.tool_calls) == 2


def test_malformed_json_gives_an_error_and_the_other_calls_are_kept():
    text = hermes_block('{"name": "add" "arguments": {}}') + hermes_block(ECHO)
    turn = parse_hermes(text)
    assert turn.tool_calls == [ToolCall("echo", {"text": "hi"})]
    assert turn.errors == [
        "Error: could not parse tool call: Expecting ',' delimiter at line 1 column 16. "
        'Write tool calls as <tool_call>{"name": "<tool name>", "arguments": {<JSON object>}}'
        "</tool_call>."
    ]
    assert turn.content == ""


def test_a_call_without_a_name_is_an_error():
    turn = parse_hermes(hermes_block('{"arguments": {"a": 1}}'))
    assert turn.tool_calls == []
    assert len(turn.errors) == 1
    assert '"name"' in turn.errors[0]


def test_a_call_whose_json_is_not_an_object_is_an_error():
    turn = parse_hermes(hermes_block('["add", {"a": 1}]'))
    assert turn.tool_calls == []
    assert "expected a JSON object, got array" in turn.errors[0]


def test_arguments_that_are_not_an_object_are_an_error():
    turn = parse_hermes(hermes_block('{"name": "add", "arguments": 3}'))
    assert turn.tool_calls == []
    assert "must be a JSON object, got number" in turn.errors[0]


def test_arguments_given_as_a_json_string_are_decoded():
    turn = parse_hermes(hermes_block('{"name": "add", "arguments": "{\\"a\\": 1}"}'))
    assert turn.tool_calls == [ToolCall("add", {"a": 1})]


def test_arguments_given_as_a_string_that_is_not_json_are_an_error():
    turn = parse_hermes(hermes_block('{"name": "add", "arguments": "a=1"}'))
    assert turn.tool_calls == []
    assert "is a string that is not JSON" in turn.errors[0]


def test_missing_arguments_mean_no_arguments():
    assert parse_hermes(hermes_block('{"name": "now"}')).tool_calls == [ToolCall("now", {})]


def test_parameters_is_accepted_as_arguments():
    turn = parse_hermes(hermes_block('{"name": "add", "parameters": {"a": 1}}'))
    assert turn.tool_calls == [ToolCall("add", {"a": 1})]


def test_an_unterminated_tool_call_is_an_error_not_content():
    turn = parse_hermes('Adding.\n<tool_call>\n{"name": "add", "arguments": {"a"')
    assert turn.content == "Adding."
    assert turn.tool_calls == []
    assert "ended before </tool_call>" in turn.errors[0]


def test_a_complete_call_before_an_unterminated_one_is_kept():
    turn = parse_hermes(hermes_block(ADD) + '<tool_call>{"name": "echo"}')
    assert [call.name for call in turn.tool_calls] == ["add"]
    assert len(turn.errors) == 1


def test_a_turn_without_tool_calls_is_all_content():
    assert parse_hermes("  The answer is 4.\n") == ParsedTurn(content="The answer is 4.")


# Llama 3 JSON


def test_a_single_llama3_call_is_parsed():
    turn = parse_llama3_json('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert turn == ParsedTurn(content="", tool_calls=[ToolCall("add", {"a": 1, "b": 2})])


def test_llama3_calls_separated_by_semicolons_or_newlines_are_all_parsed():
    text = (
        '{"name": "add", "parameters": {"a": 1}}; {"name": "echo", "parameters": {}}\n'
        '{"name": "now", "arguments": {}}'
    )
    assert [call.name for call in parse_llama3_json(text).tool_calls] == ["add", "echo", "now"]


def test_a_llama3_call_after_the_python_tag_is_parsed():
    turn = parse_llama3_json('<|python_tag|>{"name": "add", "parameters": {"a": 1}}')
    assert turn.tool_calls == [ToolCall("add", {"a": 1})]
    assert turn.errors == []


def test_llama3_text_not_starting_with_a_brace_is_plain_content():
    turn = parse_llama3_json(' The answer is {"x": 4}. ')
    assert turn == ParsedTurn(content='The answer is {"x": 4}.')


def test_a_malformed_llama3_call_is_an_error_and_the_next_call_is_kept():
    text = '{"name": "add", "parameters": {"a": 1}\n{"name": "echo", "parameters": {}}'
    turn = parse_llama3_json(text)
    assert turn.tool_calls == [ToolCall("echo", {})]
    assert turn.errors[0].startswith("Error: could not parse tool call: Expecting ','")
    assert '"parameters": {<JSON object>}' in turn.errors[0]


def test_a_llama3_object_without_a_name_is_an_error():
    turn = parse_llama3_json('{"answer": 4}')
    assert turn.tool_calls == []
    assert len(turn.errors) == 1


def test_text_after_the_last_llama3_call_is_content():
    turn = parse_llama3_json('{"name": "now", "parameters": {}}\nDone.')
    assert turn.tool_calls == [ToolCall("now", {})]
    assert turn.content == "Done."


# choosing a parser


def test_get_parser_returns_the_registered_parsers():
    assert get_parser("hermes") is parse_hermes
    assert get_parser("llama3_json") is parse_llama3_json
    assert all(get_parser(name) is parser for name, parser in PARSERS.items())
    assert {"hermes", "llama3_json", "qwen3_xml", "glm4", "atem", "harmony", "mistral"} <= set(
        PARSERS
    )


def test_get_parser_with_an_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError) as raised:
        get_parser("qwen")
    valid = ", ".join(repr(name) for name in sorted(PARSERS))
    assert str(raised.value) == f"unknown tool_call_parser 'qwen'; valid names: {valid}"
    assert "'hermes'" in valid and "'llama3_json'" in valid


HERMES_TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls or [] %}
{{- '<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
{{- tool_call.function.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endfor %}"""

LLAMA3_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'tool' %}{% set role = 'ipython' %}{% else %}{% set role = message.role %}
{%- endif %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
{%- for tool_call in message.tool_calls or [] %}
{{- '{"name": "' + tool_call.function.name + '", "parameters": ' }}
{{- tool_call.function.arguments | tojson + '}' }}
{%- endfor %}
{{- (message.content or '') + '<|eot_id|>' }}
{%- endfor %}"""

CHATML_TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_detect_parser_recognises_a_hermes_template():
    assert detect_parser(HERMES_TEMPLATE) == "hermes"


def test_detect_parser_recognises_a_llama3_template():
    assert detect_parser(LLAMA3_TEMPLATE) == "llama3_json"


def test_detect_parser_recognises_the_python_tag_and_escaped_parameters_keys():
    assert detect_parser("{{- '<|python_tag|>' + code }}") == "llama3_json"
    escaped = 'Respond as {\\"name\\": name, \\"parameters\\": args}. {{ "<|eom_id|>" }}'
    assert detect_parser(escaped) == "llama3_json"


def test_detect_parser_on_plain_chatml_asks_for_an_explicit_parser():
    with pytest.raises(ValueError, match=r"pass tool_call_parser=\.\.\."):
        detect_parser(CHATML_TEMPLATE)


def test_detect_parser_reads_xml_style_calls_inside_tool_call_tags_as_qwen3_xml():
    template = "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>"
    assert detect_parser(template) == "qwen3_xml"


def test_detect_parser_refuses_a_template_with_both_formats():
    with pytest.raises(ValueError, match="the formats of hermes and llama3_json"):
        detect_parser(HERMES_TEMPLATE + LLAMA3_TEMPLATE)


# the tokenizer's own parser


XML_RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<call name=(?P<name>\w+)>",
            "close": "</call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"<(?P<key>\w+)>(?P<value>.*?)</(?P=key)>"},
            "transform": {
                "type": "function",
                "function": {"name": "{name}", "arguments": "{content}"},
            },
        },
        "content": {"content": "text"},
    },
}


def test_tokenizer_parser_is_none_without_a_response_template():
    assert tokenizer_parser(offline_tokenizer(None)) is None


def test_tokenizer_parser_reads_content_and_tool_calls_and_drops_thinking():
    parse = tokenizer_parser(offline_tokenizer(HERMES_RESPONSE_TEMPLATE))
    turn = parse(f"<think>sum it</think>Adding.\n{hermes_block(ADD)}\n{hermes_block(ECHO)}")
    assert turn == ParsedTurn(
        content="Adding.",
        tool_calls=[ToolCall("add", {"a": 1, "b": 2}), ToolCall("echo", {"text": "hi"})],
    )


def test_tokenizer_parser_turns_a_parse_failure_into_an_error():
    parse = tokenizer_parser(offline_tokenizer(HERMES_RESPONSE_TEMPLATE))
    text = "Adding. " + hermes_block('{"name": "add",')
    turn = parse(text)
    assert turn.tool_calls == []
    assert turn.content == text.strip()
    assert len(turn.errors) == 1
    assert turn.errors[0].startswith("Error: could not parse tool call:")
    assert "\n" not in turn.errors[0]


def test_tokenizer_parser_reports_a_call_without_a_name_as_an_error():
    parse = tokenizer_parser(offline_tokenizer(HERMES_RESPONSE_TEMPLATE))
    turn = parse(hermes_block('{"arguments": {}}') + hermes_block(ECHO))
    assert turn.tool_calls == [ToolCall("echo", {"text": "hi"})]
    assert len(turn.errors) == 1


def test_tokenizer_parser_casts_string_arguments_with_the_tool_schemas():
    schema = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
    tokenizer = offline_tokenizer(XML_RESPONSE_TEMPLATE)
    text = "<call name=add><a>7</a></call>"
    untyped = tokenizer_parser(tokenizer)(text)
    typed = tokenizer_parser(tokenizer, tools=[schema])(text)
    assert untyped.tool_calls == [ToolCall("add", {"a": "7"})]
    assert typed.tool_calls == [ToolCall("add", {"a": 7})]


def test_tokenizer_parser_rejects_an_invalid_response_template_at_once():
    with pytest.raises(ValueError, match="response_template is invalid"):
        tokenizer_parser(offline_tokenizer({"fields": {}}))


def test_openai_shaped_messages_with_string_arguments_or_flat_calls_are_converted():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
            {"name": "now"},
            {"type": "function", "function": {"arguments": "{}"}},
        ],
    }
    turn = _turn_from_message(message)
    assert turn.content == ""
    assert turn.tool_calls == [ToolCall("add", {"a": 1}), ToolCall("now", {})]
    assert len(turn.errors) == 1
