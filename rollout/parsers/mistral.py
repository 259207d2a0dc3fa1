"""Parser for Mistral's `[TOOL_CALLS]` format, in both of its generations.

Older Mistral models write a JSON array of calls after the marker,
`[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]` (an `id` field may come with each call);
newer ones (tokenizer v11 on) write each call as a name and its arguments,
`[TOOL_CALLS]add[ARGS]{"a": 1}`, repeating the marker for each call (a `[CALL_ID]id` may sit
between the name and `[ARGS]`).
"""

from __future__ import annotations

from rollout.parsers.common import _BadCall, _decode, _error, _quoted, _tool_call
from rollout.types import ParsedTurn, ToolCall

_HINT = (
    'Write tool calls as [TOOL_CALLS][{"name": "<tool name>", "arguments": {<JSON object>}}] '
    "or as [TOOL_CALLS]<tool name>[ARGS]{<JSON object>}."
)
_TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"


def parse_mistral(text: str) -> ParsedTurn:
    """Parse the calls after each `[TOOL_CALLS]` marker; the text before the first is content.

    After a marker comes either a JSON array of call objects (or one object), each read like a
    Hermes call (`arguments` or `parameters`, an object or a JSON string), or a tool name,
    `[ARGS]` and a JSON object. A marker whose calls cannot be read gives one error (one per
    bad object of an array, whose other objects are still read). Text after a call's JSON is
    content too.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.

    Examples:
        >>> parse_mistral('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]').tool_calls
        [ToolCall(name='add', arguments={'a': 1})]
        >>> parse_mistral('[TOOL_CALLS]add[ARGS]{"a": 1}').tool_calls
        [ToolCall(name='add', arguments={'a': 1})]

    """
    before, *segments = text.split(_TOOL_CALLS)
    content = [before]
    calls: list[ToolCall] = []
    errors: list[str] = []
    for segment in segments:
        body = segment.strip()
        read = _json_calls if body.startswith(("[", "{")) else _named_call
        try:
            found, bad, rest = read(body)
        except _BadCall as exc:
            errors.append(_error(str(exc), _HINT))
            continue
        calls.extend(found)
        errors.extend(_error(reason, _HINT) for reason in bad)
        content.append(rest)
    return ParsedTurn(
        content="\n".join(part.strip() for part in content if part.strip()),
        tool_calls=calls,
        errors=errors,
    )


def _json_calls(body: str) -> tuple[list[ToolCall], list[str], str]:
    """Read a JSON array of calls (or one call) at the start of `body`.

    Returns:
        The calls read, the reason each unreadable one failed, and the text after the JSON.

    """
    value, end = _decode(body)
    calls: list[ToolCall] = []
    bad: list[str] = []
    for entry in value if isinstance(value, list) else [value]:
        try:
            calls.append(_tool_call(entry))
        except _BadCall as exc:
            bad.append(str(exc))
    return calls, bad, body[end:]


def _named_call(body: str) -> tuple[list[ToolCall], list[str], str]:
    """Read `NAME[CALL_ID]id[ARGS]{...}` (the call id optional) at the start of `body`."""
    head, found, arguments = body.partition(_ARGS)
    if not found:
        raise _BadCall(f"expected [ARGS] after the tool name, found {_quoted(body)}")
    name = head.split(_CALL_ID, 1)[0].strip()
    if not name or any(character.isspace() for character in name):
        raise _BadCall(f"{_quoted(name)} is not a tool name")
    arguments = arguments.lstrip()
    value, end = _decode(arguments)
    return [_tool_call({"name": name, "arguments": value})], [], arguments[end:]
