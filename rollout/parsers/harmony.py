"""Parser for gpt-oss's harmony format: tool calls are messages addressed to `functions.NAME`.

After the prompt's `<|start|>assistant`, the model writes one or more messages, each
`HEADER<|message|>BODY` closed by `<|end|>`, `<|call|>` or `<|return|>` (or the end of the text:
the stop token is removed before parsing), later ones opening with `<|start|>assistant`. The
header names the channel (`<|channel|>analysis`, `commentary` or `final`) and, for a tool call,
the recipient, before the channel or inside it: `to=functions.NAME<|channel|>commentary json` as
gpt-oss's chat template writes it, or `<|channel|>commentary to=functions.NAME <|constrain|>json`.
A tool call's body is its arguments as a JSON object.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from rollout.parsers.common import _BadCall, _check_json, _error, _json_type, _loads
from rollout.types import ParsedTurn, ToolCall

_HINT = (
    "Write a tool call as <|start|>assistant to=functions.<tool name><|channel|>commentary "
    "json<|message|>{<JSON object>}<|call|>."
)
_START = "<|start|>"
_MESSAGE = "<|message|>"
_END = re.compile(r"<\|(?:end|call|return)\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]*)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w*)")
_FUNCTIONS = "functions."


def parse_harmony(text: str) -> ParsedTurn:
    """Parse one harmony assistant turn: its tool calls, and its text as `content`.

    A message with a recipient is a tool call: the name is the recipient less `functions.`
    (a built-in recipient such as `browser.search` is kept whole, so the tool layer can say it
    is unknown), the arguments its body, an object (an empty body means `{}`). A body that is
    not a JSON object, or an empty name, is an error. `content` is the text of the `final`
    channel when the turn has one, otherwise the bodies of its other messages (analysis,
    commentary preambles) one per line, which is how gpt-oss's template shows the reasoning
    before a tool call. Text with no `<|message|>` at all is plain content.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.

    Examples:
        >>> turn = parse_harmony(
        ...     ' to=functions.add<|channel|>commentary json<|message|>{"a": 1}'
        ... )
        >>> turn.tool_calls
        [ToolCall(name='add', arguments={'a': 1})]
        >>> parse_harmony("<|channel|>final<|message|>It is 3.").content
        'It is 3.'

    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    texts: list[str] = []
    final: list[str] = []
    for header, body in _messages(text):
        recipient = _RECIPIENT.search(header)
        if recipient is None:
            channel = _CHANNEL.search(header)
            is_final = channel is not None and channel.group(1) == "final"
            (final if is_final else texts).append(body.strip())
            continue
        try:
            calls.append(_call(recipient.group(1), body))
        except _BadCall as exc:
            errors.append(_error(str(exc), _HINT))
    content = "\n".join(part for part in (final or texts) if part)
    return ParsedTurn(content=content, tool_calls=calls, errors=errors)


def _messages(text: str) -> list[tuple[str, str]]:
    """Split a turn into (header, body) pairs; text outside any message is a headerless body."""
    messages = []
    for chunk in text.split(_START):
        header, found, body = chunk.partition(_MESSAGE)
        if not found:
            header, body = "", chunk
        body, *after = _END.split(body, maxsplit=1)
        messages.append((header, body))
        if after and after[0].strip():  # text after a message's end, before any <|start|>
            messages.append(("", after[0]))
    return [(header, body) for header, body in messages if header or body.strip()]


def _call(recipient: str, body: str) -> ToolCall:
    """The call a message to `recipient` makes; raise `_BadCall` if it cannot be read."""
    name = recipient.removeprefix(_FUNCTIONS)
    if not name:
        raise _BadCall(f"the recipient {recipient!r} names no tool")
    arguments = _loads(body) if body.strip() else {}
    _check_json([name, arguments])
    if not isinstance(arguments, Mapping):
        got = _json_type(arguments)
        raise _BadCall(f"the arguments of {name!r} must be a JSON object, got {got}")
    return ToolCall(name=name, arguments=dict(arguments))
