r"""What every tool-call parser shares: reading JSON from model text, and the error format.

A parser turns what the model wrote into data, never an exception: `_BadCall` carries the reason
a call cannot be read, and `_error` words it for the model. JSON that no later stage could handle
is a bad call too: nesting deeper than `MAX_JSON_DEPTH`, an integer longer than Python converts
(`sys.get_int_max_str_digits()`), or a string holding a lone surrogate escape (`"\ud800"`),
which no tokenizer encodes. The names are private to the `rollout` parsers.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from typing import Any

from rollout.types import ToolCall

_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
# Deeper JSON is refused: every later step (the template's `tojson`, logs, tools) recurses over
# it, and Python's recursion limit (1000 frames, shared with the caller's stack) must hold there.
MAX_JSON_DEPTH = 128
_TOO_DEEP = f"the JSON nests deeper than {MAX_JSON_DEPTH} levels"
_SURROGATE = re.compile("[\ud800-\udfff]")


class _BadCall(ValueError):
    """A tool call that cannot be read; the message says why, in words for the model."""


class _NotJson(_BadCall):
    """The text is not JSON at all (as opposed to JSON no tool call may hold)."""


def _error(reason: str, hint: str = "") -> str:
    message = f"Error: could not parse tool call: {_escaped(reason).rstrip('.')}."
    return f"{message} {hint}" if hint else message


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), "number" if isinstance(value, int | float) else "value")


def _json_reason(exc: json.JSONDecodeError) -> str:
    return f"{exc.msg} at line {exc.lineno} column {exc.colno}"


def _json_int(digits: str) -> int:
    """Read a JSON integer literal; one too long for Python to convert is the model's mistake."""
    try:
        return int(digits)
    except ValueError:  # over sys.get_int_max_str_digits(): int() refuses it
        limit = sys.get_int_max_str_digits()
        raise _BadCall(f"an integer has {len(digits.lstrip('-'))} digits, over {limit}") from None


_DECODER = json.JSONDecoder(parse_int=_json_int)


def _decode(text: str, start: int = 0) -> tuple[Any, int]:
    """`raw_decode` one JSON value at `start`: the value and the index after it.

    Raises:
        _NotJson: The text is not JSON there.
        _BadCall: The text is JSON no tool call may hold: nested too deep for the decoder, or
            an integer too long to convert.

    """
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        raise _NotJson(_json_reason(exc)) from None
    except RecursionError:  # nested far deeper than MAX_JSON_DEPTH: refused all the same
        raise _BadCall(_TOO_DEEP) from None


def _loads(text: str) -> Any:
    """Decode a whole JSON text (surrounding whitespace allowed), like `json.loads`."""
    text = text.strip()  # so a line number counts from the JSON's first line, as the model sees
    value, end = _decode(text)
    if end != len(text):
        raise _NotJson(_json_reason(json.JSONDecodeError("Extra data", text, end)))
    return value


def _check_json(value: Any) -> None:
    r"""Raise `_BadCall` if a decoded value nests too deep or holds a lone surrogate.

    A lone surrogate (`"\ud800"` unpaired) decodes to a string that is not valid Unicode: no
    tokenizer can encode it and no UTF-8 file can hold it. The walk is iterative, so it never
    recurses whatever the depth.
    """
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            if not item.isascii() and (bad := _SURROGATE.search(item)):
                raise _BadCall(
                    f"the string {_quoted(item)} holds a lone surrogate "
                    f"\\u{ord(bad.group()):04x}, which is not a Unicode character"
                )
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _BadCall(_TOO_DEEP)
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        pending.extend((child, depth + 1) for child in children)


def _quoted(text: str, width: int = 40) -> str:
    """A short quote of a string, as `_escaped`."""
    shown = _escaped(text[:width])
    return f'"{shown}..."' if len(text) > width else f'"{shown}"'


def _escaped(text: str) -> str:
    r"""`text` with its lone surrogates written as escapes (`\ud800`), so it can be encoded."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _arguments(call: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Return a call's arguments: `arguments`, else `parameters`; absent, null or "" mean {}."""
    key = "arguments" if "arguments" in call else "parameters"
    arguments = call.get(key)
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):  # OpenAI style: the arguments object encoded as a string
        try:
            arguments = _loads(arguments)
        except _BadCall as exc:
            raise _BadCall(f'"{key}" of {name!r} is a string that is not JSON') from exc
        _check_json(arguments)
    if not isinstance(arguments, Mapping):
        raise _BadCall(f'"{key}" of {name!r} must be a JSON object, got {_json_type(arguments)}')
    return dict(arguments)


def _tool_call(call: Any) -> ToolCall:
    """Read one decoded call `{"name": str, "arguments": {...}}`; raise `_BadCall` if it is not."""
    _check_json(call)
    if not isinstance(call, Mapping):
        raise _BadCall(f"expected a JSON object, got {_json_type(call)}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise _BadCall('the "name" field is missing or not a string')
    return ToolCall(name=name, arguments=_arguments(call, name))
