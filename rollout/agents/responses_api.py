"""OpenAI's Responses API (`POST .../v1/responses`) as the chat requests a session answers.

An agent written against `client.responses.create(...)` (Codex-style) trains as a chat-completions
agent does: its request is turned into the same chat messages, so the session finds the row it
continues and appends to it token-exactly, and the reply comes back as Responses output items.

Request (`responses_request`): `instructions` is a system message first; `input` is a string (one
user message) or a list of items: messages (`role` user, system, developer or assistant, content a
string or `input_text` / `output_text` parts), `function_call` items (`call_id`, `name`,
`arguments`), which join the assistant message just before them, and `function_call_output`
items (`call_id`, `output`), each a tool message. `previous_response_id` (a response of the same
episode) puts that response's conversation before `input`; the earlier `instructions` are not
carried over, as in OpenAI's API. `tools` are function tools (`type: "function"`, `name`,
`description`, `parameters`), shown to the model as a chat-completions tool's `function`;
`tool_choice: "none"` offers none. `max_output_tokens` caps the reply;
`include: ["message.output_text.logprobs"]` adds the sampler logprobs; `"return_token_ids": true`
(in `extra_body`) adds `prompt_token_ids` and `token_ids`. Reasoning and other item kinds, tools
other than functions, structured output (`text.format`) and `background` are refused with status
400, naming what works.

Reply (`response_json`): a `response` object whose `output` is a `message` item (its
`output_text`, when there is text or no tool call) and one `function_call` item per parsed call;
`status` is `incomplete` (`max_output_tokens`) when the reply was cut off. `"stream": true` gets
the same response as server-sent events once it is whole (`response_events`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout.agents.session import ChatReply, ChatRequest, RequestError, template_messages
from rollout.agents.wire import (
    arguments_json,
    flag,
    sse,
    string,
    text_of,
    token_logprobs,
    whole_number,
)

_TEXT_PARTS = ("input_text", "output_text")
_ROLES = ("user", "system", "developer", "assistant")
LOGPROBS = "message.output_text.logprobs"


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request: its body, the chat request it makes, and where its history starts.

    Attributes:
        body: The JSON body as sent.
        chat: The chat request the session answers.
        history_from: Index of `chat.messages` after the `instructions` message (0 or 1): what
            a later request's `previous_response_id` carries over starts there.
    """

    body: dict[str, Any]
    chat: ChatRequest
    history_from: int

    def conversation(self, reply: ChatReply) -> list[dict[str, Any]]:
        """What a later `previous_response_id` naming this reply's response continues."""
        return [*self.chat.messages[self.history_from :], reply.message]


def responses_request(body: Any, earlier: Mapping[str, list[dict[str, Any]]]) -> ResponsesRequest:
    """The chat request a `/v1/responses` body asks for.

    Args:
        body: The JSON body.
        earlier: The conversation of each earlier response of the episode, by response id.

    Raises:
        RequestError: A field the endpoint cannot honour, or one of the wrong type (named).
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in ("stream", "return_token_ids", "background"):
        flag(body, name)
    if body.get("background"):
        raise RequestError("'background' responses are not supported: ask without it")
    text = body.get("text")
    format_type = (text.get("format") or {}).get("type") if isinstance(text, dict) else None
    if format_type not in (None, "text"):
        raise RequestError(
            f"text.format {format_type!r} is not supported: the reply is plain text ('text')"
        )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append(
            {"role": "system", "content": text_of(instructions, _TEXT_PARTS, "instructions")}
        )
    history_from = len(messages)
    messages += _previous(body, earlier)
    messages += _input_messages(body.get("input"))
    include = body.get("include") or []
    if not isinstance(include, list):
        raise RequestError("'include' must be a list of strings")
    tools = _tools(body.get("tools"))
    chat = ChatRequest(
        template_messages(messages),
        [] if body.get("tool_choice") == "none" else tools,
        whole_number(body, "max_output_tokens"),
        logprobs=LOGPROBS in include,
        token_ids=flag(body, "return_token_ids"),
    )
    return ResponsesRequest(body, chat, history_from)


def _previous(
    body: Mapping[str, Any], earlier: Mapping[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    if not isinstance(previous, str) or previous not in earlier:
        raise RequestError(
            f"previous_response_id {previous!r} is no response of this episode: name one this "
            f"session returned, or send the whole conversation as 'input'"
        )
    return list(earlier[previous])


def _input_messages(items: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: tool calls join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a non-empty list of input items")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} is a {type(item).__name__}, not an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise RequestError(f"{where}.role is {role!r}; expected one of {list(_ROLES)}")
            content = text_of(item.get("content"), _TEXT_PARTS, f"{where}.content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {
                "id": string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": string(item, "name", where),
                    "arguments": string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = text_of(item.get("output"), ("input_text",), f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": string(item, "call_id", where), "content": output}
            )
        else:
            raise RequestError(
                f"{where} is a {kind!r} item; supported: message, function_call, "
                f"function_call_output (this endpoint makes no reasoning or other items)"
            )
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools as chat-completions tools (`{"type": "function", "function": {...}}`)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of function tools")
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(
                f"tools[{index}] is a {kind!r} tool; only function tools ({{'type': 'function', "
                f"'name': ..., 'parameters': {{...}}}}) are supported: the agent runs its own tools"
            )
        string(tool, "name", f"tools[{index}]")
        for key, kinds in (("description", str), ("parameters", dict)):
            if not isinstance(tool.get(key), kinds | None):
                raise RequestError(f"tools[{index}].{key} must be a {kinds.__name__}")
        # The chat form's function is the Responses tool less its type: the template shows the
        # same schema a chat-completions agent's tool shows.
        function = {key: value for key, value in tool.items() if key != "type"}
        converted.append({"type": "function", "function": function})
    return converted


def response_json(reply: ChatReply, request: ResponsesRequest, model: str) -> dict[str, Any]:
    """The `response` object of a reply (see the module docstring)."""
    body, cut = request.body, reply.finish_reason == "length"
    response: dict[str, Any] = {
        "id": f"resp_{secrets.token_hex(16)}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": model,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "output": _output_items(reply, request.chat.logprobs),
        "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "max_output_tokens": body.get("max_output_tokens"),
        "text": {"format": {"type": "text"}},
        "metadata": {},
        "usage": {
            "input_tokens": len(reply.prompt_ids),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": len(reply.completion_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(reply.prompt_ids) + len(reply.completion_ids),
        },
    }
    if request.chat.token_ids:
        response["prompt_token_ids"] = reply.prompt_ids
        response["token_ids"] = reply.completion_ids
    return response


def _output_items(reply: ChatReply, logprobs: bool) -> list[dict[str, Any]]:
    """The reply as output items: a `message` (text, or no tool call), then its `function_call`s."""
    message = reply.message
    calls = message.get("tool_calls") or []
    output: list[dict[str, Any]] = []
    if message["content"] or not calls:
        part: dict[str, Any] = {
            "type": "output_text",
            "text": message["content"],
            "annotations": [],
        }
        if logprobs:
            part["logprobs"] = token_logprobs(reply.tokens, reply.logprobs)
        status = "incomplete" if reply.finish_reason == "length" else "completed"
        output.append(
            {
                "type": "message",
                "id": f"msg_{secrets.token_hex(12)}",
                "status": status,
                "role": "assistant",
                "content": [part],
            }
        )
    for call in calls:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{call['id']}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": arguments_json(call["function"]["arguments"]),
                "status": "completed",
            }
        )
    return output


def response_events(response: dict[str, Any]) -> list[bytes]:
    """A whole `response` as the server-sent events of a streamed one.

    `response.created` and `response.in_progress` (no output yet), each output item added, its
    text or arguments as one delta, done, then `response.completed` (`response.incomplete` for a
    reply cut off) with the whole response.
    """
    started = {**response, "status": "in_progress", "output": [], "incomplete_details": None}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    for index, item in enumerate(response["output"]):
        events += _item_events(index, item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.append({"type": final, "response": response})
    return [
        sse(event["type"], {**event, "sequence_number": number})
        for number, event in enumerate(events)
    ]


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """The events streaming one output item: added, its content in one delta, done."""
    at = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "function_call":
        added = {**item, "arguments": "", "status": "in_progress"}
        content = [
            {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
            {"type": "response.function_call_arguments.done", **at, "name": item["name"],
             "arguments": item["arguments"]},
        ]  # fmt: skip
    else:
        [part] = item["content"]
        empty = {"type": "output_text", "text": "", "annotations": []}
        added = {**item, "content": [], "status": "in_progress"}
        logprobs = part.get("logprobs", [])
        text = {**at, "content_index": 0, "logprobs": logprobs}
        content = [
            {"type": "response.content_part.added", **at, "content_index": 0, "part": empty},
            {"type": "response.output_text.delta", **text, "delta": part["text"]},
            {"type": "response.output_text.done", **text, "text": part["text"]},
            {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
        ]
    return [
        {"type": "response.output_item.added", "output_index": index, "item": added},
        *content,
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]
