"""A turn's tool calls: run in the order the environment needs; the messages and records made.

Calls on the environment share its state, so they run one at a time in the model's order; calls
to plain tools run concurrently. Results become tool messages the model reads (with any images
as content parts) and `ToolCallRecord`s for the episode record.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import anyio

from rollout.images import text_of, tool_content
from rollout.text_encoding import valid_unicode
from rollout.types import ParsedTurn, ToolCall, ToolCallRecord
from tools import Tool, ToolResult, call_tool


async def run_calls(
    calls: list[ToolCall],
    tools: Mapping[str, Tool],
    concurrent: Collection[str],
    timeout_s: float | None,
) -> list[ToolResult]:
    """Run a turn's tool calls; results keep the calls' order.

    Calls on the environment (every call not to one of the plain tools named in `concurrent`)
    share the instance's state, so they run one at a time, in the order the model wrote them.
    Each call to a plain tool runs concurrently with the rest.
    """
    results: list[ToolResult | None] = [None] * len(calls)

    async def run_in_order(indices: list[int]) -> None:
        for i in indices:
            results[i] = await call_tool(tools, calls[i].name, calls[i].arguments, timeout_s)

    async with anyio.create_task_group() as group:
        group.start_soon(run_in_order, [i for i, c in enumerate(calls) if c.name not in concurrent])
        for i, call in enumerate(calls):
            if call.name in concurrent:
                group.start_soon(run_in_order, [i])
    return results  # type: ignore[return-value]


def call_records(
    parsed: ParsedTurn, results: list[ToolResult], shown: list[dict]
) -> list[ToolCallRecord]:
    """The turn's calls with their results, then its unparseable calls, in message order.

    Each result is the text of its tool message in `shown` (cut where the model was shown a
    cut text), with the whole text's length where it was cut.
    """
    ran: list[tuple[str | None, Mapping[str, Any], str, str | None]] = [
        (c.name, c.arguments, r.content, None if r.error is None else str(r.error))
        for c, r in zip(parsed.tool_calls, results, strict=True)
    ]
    calls = ran + [(None, {}, message, "parse") for message in parsed.errors]
    return [
        ToolCallRecord(
            name,
            arguments,
            text_of(shown_message["content"]),
            error,
            _cut_from(whole, text_of(shown_message["content"])),
        )
        for (name, arguments, whole, error), shown_message in zip(calls, shown, strict=True)
    ]


def _cut_from(whole: str, shown: str) -> int | None:
    """The length of `whole` when `shown` is a cut of it, else None."""
    return len(whole) if len(shown) < len(whole) else None


def assistant_message(text: str, parsed: ParsedTurn) -> dict[str, Any]:
    """The model's turn as a chat message: its text, or its content and the calls it made."""
    if not parsed.tool_calls:
        return {"role": "assistant", "content": text}
    calls = [
        {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
        for c in parsed.tool_calls
    ]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}


def tool_message(name: str, content: str, images: tuple[Any, ...] = ()) -> dict[str, Any]:
    """A tool message; lone surrogates a tool returned become U+FFFD, so it can be encoded.

    With images, the content is parts: the images, then the text (`rollout.images.tool_content`).
    """
    return {"role": "tool", "name": name, "content": tool_content(valid_unicode(content), images)}
