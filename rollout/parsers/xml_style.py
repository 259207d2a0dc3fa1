r"""Parsers for the XML-style tool formats, whose argument values are untyped text.

Three families write a call as markup with one element per argument:

- `qwen3_xml` (Qwen3.5, Qwen3.6, Qwen3.8, Qwen3-Coder, Nemotron 3):
  `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`
- `glm4` (GLM-4.5 / 4.6 MoE):
  `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>`
- `atem` (Muse Glimmer): `<atem:function_calls>\n<atem:invoke name="NAME">\n`
  `<atem:parameter name="KEY">VALUE</atem:parameter>\n</atem:invoke>\n</atem:function_calls>`,
  inside ATEM messages (`<|start|>assistant to=RECIPIENT<|message|>BODY<|eom|>`).

A value is text, so `3` may be the integer or the string. Given the tool schemas (`tools=`, as
`get_parser(name, tools=...)` passes them), each value is read against its parameter's schema:
a `string` parameter keeps the text as written; any other reads the text as JSON (or as the
Python literals `True`, `False`, `None` that some templates write) when that gives a value of a
type the schema allows, and keeps the text otherwise (the tool's argument check then says what
is wrong). Without a schema for the parameter a value stays text.

Like every parser, these never raise on what the model wrote: a call they cannot read (no
name, a parameter left open, a key given twice, text where markup belongs, JSON past the limits
of `rollout.parsers.common`) is one error message, and the other calls are still read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout.parsers.common import _BadCall, _check_json, _error, _loads, _NotJson, _quoted
from rollout.types import ParsedTurn, ToolCall

ToolSchemas = Sequence[Mapping[str, Any]]

_QWEN3_XML_HINT = (
    "Write tool calls as <tool_call>\n<function=<tool name>>\n<parameter=<argument name>>\n"
    "<value>\n</parameter>\n</function>\n</tool_call>."
)
_GLM4_HINT = (
    "Write tool calls as <tool_call><tool name>\n<arg_key><argument name></arg_key>\n"
    "<arg_value><value></arg_value>\n</tool_call>."
)
_ATEM_HINT = (
    'Write tool calls as <atem:function_calls>\n<atem:invoke name="<tool name>">\n'
    '<atem:parameter name="<argument name>"><value></atem:parameter>\n</atem:invoke>\n'
    "</atem:function_calls>."
)
# A block runs to its closing tag, or to the end of the text when the model stopped inside it
# (group 2 is then empty).
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_ATEM_BLOCK = re.compile(r"<atem:function_calls>(.*?)(</atem:function_calls>|\Z)", re.DOTALL)
_QWEN3_FUNCTION = re.compile(r"\s*<function=([^>]*)>(.*?)</function>\s*", re.DOTALL)
_QWEN3_PARAMETER = re.compile(r"\s*<parameter=([^>]*)>(.*?)</parameter>\s*", re.DOTALL)
_GLM4_NAME = re.compile(r"[^<]*")
_GLM4_ARGUMENT = re.compile(
    r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL
)
_ATEM_INVOKE = re.compile(r'\s*<atem:invoke name="([^"]*)">(.*?)</atem:invoke>\s*', re.DOTALL)
_ATEM_PARAMETER = re.compile(
    r'\s*<atem:parameter name="([^"]*)">(.*?)</atem:parameter>\s*', re.DOTALL
)
_ATEM_START = "<|start|>assistant"
_ATEM_MESSAGE = "<|message|>"
_ATEM_END = re.compile(r"<\|eo[mt]\|>")
_ATEM_RECIPIENT = re.compile(r"\bto=(\S+)")
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}
_JSON_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def parse_qwen3_xml(text: str, tools: ToolSchemas | None = None) -> ParsedTurn:
    r"""Parse `<tool_call>` blocks holding `<function=NAME>` with `<parameter=KEY>` elements.

    A value is the text between `<parameter=KEY>` and `</parameter>`, less the one newline the
    format puts on each side; it is typed against `tools` (see the module docstring). Each
    `<tool_call>` block must hold exactly one `<function=...>...</function>` made only of
    parameters; anything else in it, or a block or element left open, is an error for that
    block. `content` is the text outside the blocks, stripped.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.
        tools: The tool schemas offered (`{"type": "function", "function": {...}}`), or None.

    Examples:
        >>> call = "<function=add>\n<parameter=a>\n1\n</parameter>\n</function>"
        >>> text = f"Sure.\n<tool_call>\n{call}\n</tool_call>"
        >>> parse_qwen3_xml(text).tool_calls
        [ToolCall(name='add', arguments={'a': '1'})]
        >>> schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        >>> tools = [{"type": "function", "function": {"name": "add", "parameters": schema}}]
        >>> turn = parse_qwen3_xml(text, tools)
        >>> turn.content, turn.tool_calls
        ('Sure.', [ToolCall(name='add', arguments={'a': 1})])

    """

    def read(body: str) -> ToolCall:
        function = _QWEN3_FUNCTION.fullmatch(body)
        if function is None:
            raise _BadCall("expected one <function=NAME>...</function> inside <tool_call>")
        pairs = _pairs(_QWEN3_PARAMETER, function.group(2), "<parameter=KEY>...</parameter>")
        values = [(key, _strip_one_newline(value)) for key, value in pairs]
        return _typed_call(function.group(1), values, tools)

    return _parse_blocks(text, _TOOL_CALL_BLOCK, "</tool_call>", read, _QWEN3_XML_HINT)


def parse_glm4(text: str, tools: ToolSchemas | None = None) -> ParsedTurn:
    r"""Parse GLM-4 `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>`.

    The name is the text before the first `<arg_key>`, stripped; each value is the text between
    its tags, typed against `tools` (see the module docstring). A block that is not a name and
    key/value pairs, or is left open, is an error. `content` is the text outside the blocks,
    stripped.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.
        tools: The tool schemas offered (`{"type": "function", "function": {...}}`), or None.

    Examples:
        >>> text = "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
        >>> parse_glm4(text).tool_calls
        [ToolCall(name='add', arguments={'a': '1'})]

    """

    def read(body: str) -> ToolCall:
        name = _GLM4_NAME.match(body)
        assert name is not None  # the pattern matches the empty string
        pairs = _pairs(_GLM4_ARGUMENT, body[name.end() :], "<arg_key>/<arg_value> pairs")
        return _typed_call(name.group(), pairs, tools)

    return _parse_blocks(text, _TOOL_CALL_BLOCK, "</tool_call>", read, _GLM4_HINT)


def parse_atem(text: str, tools: ToolSchemas | None = None) -> ParsedTurn:
    """Parse Muse Glimmer's ATEM messages and their `<atem:invoke>` tool calls.

    The turn is one or more messages, `[<|start|>assistant] to=RECIPIENT<|message|>BODY`, each
    ending with `<|eom|>`, `<|eot|>` or the end of the text (a turn without `<|message|>` is
    one message, all body). Messages to `self` are reasoning and are dropped. In the others,
    every `<atem:function_calls>` block holds `<atem:invoke name="NAME">` calls whose
    `<atem:parameter name="KEY">` values are kept exactly as written (the format does not strip
    them) and typed against `tools`; a block that holds anything else, or is left open, is an
    error. `content` is the text of the messages outside the blocks, stripped, one message per
    line.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.
        tools: The tool schemas offered (`{"type": "function", "function": {...}}`), or None.

    """
    bodies = [body for recipient, body in _atem_messages(text) if recipient != "self"]

    def read(block: str) -> list[ToolCall]:
        calls = []
        for name, body in _pairs(_ATEM_INVOKE, block, '<atem:invoke name="NAME"> elements'):
            pairs = _pairs(_ATEM_PARAMETER, body, '<atem:parameter name="KEY"> elements')
            calls.append(_typed_call(name, pairs, tools))
        return calls

    turns = [
        _parse_blocks(body, _ATEM_BLOCK, "</atem:function_calls>", read, _ATEM_HINT)
        for body in bodies
    ]
    return ParsedTurn(
        content="\n".join(turn.content for turn in turns if turn.content),
        tool_calls=[call for turn in turns for call in turn.tool_calls],
        errors=[error for turn in turns for error in turn.errors],
    )


def _atem_messages(text: str) -> list[tuple[str | None, str]]:
    """Split an ATEM turn into (recipient or None, body) pairs, end tokens removed."""
    messages: list[tuple[str | None, str]] = []
    for chunk in text.split(_ATEM_START):
        header, found, body = chunk.partition(_ATEM_MESSAGE)
        if not found:
            header, body = "", chunk
        recipient = _ATEM_RECIPIENT.search(header)
        body = _ATEM_END.split(body, maxsplit=1)[0]
        if recipient is not None or body.strip():
            messages.append((recipient.group(1) if recipient else None, body))
    return messages


def _parse_blocks(
    text: str,
    block: re.Pattern[str],
    closing: str,
    read: Callable[[str], ToolCall | list[ToolCall]],
    hint: str,
) -> ParsedTurn:
    """Read every `block` match of `text` with `read`; the text outside them is the content.

    `block` has two groups: the body, and the closing tag (empty when the text ended first,
    which is an error). A block `read` cannot read gives one error and the rest are still read.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    outside: list[str] = []
    end = 0
    for match in block.finditer(text):
        outside.append(text[end : match.start()])
        end = match.end()
        if not match.group(2):
            errors.append(_error(f"the turn ended before {closing}", hint))
            continue
        try:
            found = read(match.group(1))
        except _BadCall as exc:
            errors.append(_error(str(exc), hint))
            continue
        calls.extend(found if isinstance(found, list) else [found])
    outside.append(text[end:])
    return ParsedTurn(content="".join(outside).strip(), tool_calls=calls, errors=errors)


def _pairs(element: re.Pattern[str], text: str, expected: str) -> list[tuple[str, str]]:
    """The (group 1, group 2) of each `element` that, with whitespace between, make up `text`.

    Raises:
        _BadCall: Some text is not such an element (or one is left open).

    """
    pairs: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        match = element.match(text, pos)
        if match is None:
            if not text[pos:].strip():
                break
            raise _BadCall(f"expected {expected}, found {_quoted(text[pos:].strip())}")
        pairs.append((match.group(1), match.group(2)))
        pos = match.end()
    return pairs


def _strip_one_newline(value: str) -> str:
    """`value` less the one newline the format writes after the opening and before the closing."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _typed_call(name: str, pairs: list[tuple[str, str]], tools: ToolSchemas | None) -> ToolCall:
    """The call to `name` with the (key, value text) pairs typed against its schema in `tools`.

    Raises:
        _BadCall: The name is empty or holds whitespace, a key is given twice, or a value is
            JSON no tool call may hold.

    """
    name = name.strip()
    if not name or any(character.isspace() for character in name):
        raise _BadCall(f"{_quoted(name)} is not a tool name")
    properties = _properties(tools, name)
    arguments: dict[str, Any] = {}
    for key, text in pairs:
        if key in arguments:
            raise _BadCall(f"the argument {_quoted(key)} of {name!r} is given twice")
        arguments[key] = _typed_value(text, properties.get(key))
    _check_json([name, arguments])
    return ToolCall(name=name, arguments=arguments)


def _properties(tools: ToolSchemas | None, name: str) -> Mapping[str, Any]:
    """The parameter schemas (`properties`) of the tool called `name` in `tools`, or {}."""
    for tool in tools or ():
        function = tool.get("function", tool)
        if isinstance(function, Mapping) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, Mapping) else {}
    return {}


def _typed_value(text: str, schema: Any) -> Any:
    """`text` read as its parameter's schema asks (see the module docstring).

    Raises:
        _BadCall: The text is JSON no tool call may hold (too deep, an integer too long).

    """
    if not isinstance(schema, Mapping):
        return text
    types = _schema_types(schema)
    if types == {"string"}:
        return text
    try:
        value = _loads(text)
    except _NotJson:
        value = _PYTHON_LITERALS.get(text.strip(), text)
    if value is text or isinstance(value, str):  # strings are written bare, never quoted
        return text
    checks = [_JSON_TYPE_CHECKS.get(type_name, lambda v: True) for type_name in types]
    return value if not checks or any(check(value) for check in checks) else text


def _schema_types(schema: Mapping[str, Any]) -> set[str]:
    """The JSON type names a schema allows: `type` (a name or a list), `anyOf`, `oneOf`."""
    declared = schema.get("type")
    types = set(declared) if isinstance(declared, list) else {declared} if declared else set()
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            if isinstance(branch, Mapping):
                types |= _schema_types(branch)
    if schema.get("nullable"):
        types.add("null")
    return {str(type_name) for type_name in types}
