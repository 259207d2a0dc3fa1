"""The chat messages of the built-ins' demonstrations, and numbers as their tools print them."""

from __future__ import annotations

from typing import Any


def tool_turn(name: str, arguments: dict[str, Any], result: str) -> list[dict[str, Any]]:
    """An assistant message calling one tool, and the tool's result.

    Examples:
        >>> [m["role"] for m in tool_turn("add", {"a": 1, "b": 2}, "3")]
        ['assistant', 'tool']

    """
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": name, "content": result},
    ]


def number_text(value: float) -> str:
    """A number as the calculator prints it: ``12`` for 12.0, ``3.5`` otherwise.

    Examples:
        >>> number_text(12.0), number_text(3.5)
        ('12', '3.5')

    """
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))
