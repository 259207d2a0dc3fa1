"""Anthropic's Messages API (`POST .../v1/messages`) as the chat requests a session answers.

An agent written against the `anthropic` client's `messages.create(...)` (Claude-Code-style)
trains as a chat-completions agent does: its request becomes the same chat messages, so the
session finds the row it continues and appends to it token-exactly, and the reply comes back as
content blocks. `anthropic_client` points an `anthropic` client at an episode's session.

Request (`messages_request`): `system` (a string or text blocks) is a system message first; each
of `messages` is a user or assistant turn whose content is a string or blocks: `text`, `tool_use`
(`id`, `name`, `input`: the assistant's calls, which join its text) and `tool_result`
(`tool_use_id`, `content`: a string or text blocks), each result a tool message in the order
given. `tools` are client tools (`name`, `description`, `input_schema`); `tool_choice` of type
`none` offers none. `max_tokens` caps the reply; `"return_token_ids": true` (in `extra_body`)
adds `prompt_token_ids` and `token_ids`. Images, documents, thinking blocks, server tools and
`stop_sequences` are refused with status 400, naming what works; sampling fields (`temperature`,
`top_p`, `top_k`) give way to the run's, as on the other routes.

Reply (`message_json`): a `message` whose content is a `text` block (when there is text) and one
`tool_use` block per parsed call; `stop_reason` is `tool_use`, `end_turn` or `max_tokens`.
`"stream": true` gets the same message as server-sent events once it is whole
(`message_events`). Errors have Anthropic's form (`anthropic_error`).
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from rollout.agents.session import ChatReply, ChatRequest, RequestError, template_messages
from rollout.agents.wire import flag, sse, string, text_of, whole_number

if TYPE_CHECKING:
    import anthropic
    import openai

_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
_ERROR_TYPES = {404: "not_found_error", 413: "request_too_large"}


def messages_request(body: Any) -> ChatRequest:
    """The chat request a `/v1/messages` body asks for.

    Raises:
        RequestError: A field the endpoint cannot honour, or one of the wrong type (named).
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    flag(body, "stream")
    if body.get("stop_sequences"):
        raise RequestError("stop_sequences are not supported: a turn ends on the model's own")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": text_of(body["system"], ("text",), "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError("'messages' must be a non-empty list of user and assistant turns")
    for index, turn in enumerate(turns):
        messages += _turn(turn, f"messages[{index}]")
    tool_choice = body.get("tool_choice")
    offered = not (isinstance(tool_choice, dict) and tool_choice.get("type") == "none")
    return ChatRequest(
        template_messages(messages),
        _tools(body.get("tools")) if offered else [],
        whole_number(body, "max_tokens"),
        token_ids=flag(body, "return_token_ids"),
    )


def _turn(turn: Any, where: str) -> list[dict[str, Any]]:
    """One user or assistant turn as chat messages (a user turn's tool results come apart)."""
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where} must be an object with role 'user' or 'assistant'")
    role, content = turn["role"], turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, at))
        elif kind == "tool_result" and role == "user":
            result = text_of(block.get("content") or "", ("text",), f"{at}.content")
            messages.append({"role": "tool", "tool_call_id": string(block, "tool_use_id", at),
                             "content": result})  # fmt: skip
        else:
            raise RequestError(
                f"{at} is a {kind or type(block).__name__!r} block (role {role}); supported: "
                f"text, tool_use (assistant) and tool_result (user)"
            )
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(text), "tool_calls": calls}]
    return [*messages, {"role": "user", "content": "".join(text)}] if text else messages


def _call(block: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.input must be an object (the tool's arguments)")
    name = string(block, "name", where)
    return {"id": string(block, "id", where), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Client tools as chat-completions tools (`{"type": "function", "function": {...}}`)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of tools")
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("input_schema"), dict):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(
                f"tools[{index}] ({kind!r}) has no input_schema; only client tools "
                f"({{'name': ..., 'input_schema': {{...}}}}) are supported: the agent runs its "
                f"own tools"
            )
        function: dict[str, Any] = {"name": string(tool, "name", f"tools[{index}]")}
        if tool.get("description") is not None:
            function["description"] = string(tool, "description", f"tools[{index}]")
        function["parameters"] = tool["input_schema"]
        converted.append({"type": "function", "function": function})
    return converted


def message_json(reply: ChatReply, request: ChatRequest, model: str) -> dict[str, Any]:
    """The Messages API `message` of a reply (see the module docstring)."""
    content: list[dict[str, Any]] = []
    if reply.message["content"]:
        content.append({"type": "text", "text": reply.message["content"]})
    for call in reply.message.get("tool_calls") or []:
        function = call["function"]  # its arguments an object: the session parsed them
        content.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"],
             "input": function["arguments"]}
        )  # fmt: skip
    message: dict[str, Any] = {
        "id": f"msg_{secrets.token_hex(16)}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _STOP_REASONS[reply.finish_reason],
        "stop_sequence": None,
        "usage": {
            "input_tokens": len(reply.prompt_ids),
            "output_tokens": len(reply.completion_ids),
        },
    }
    if request.token_ids:
        message["prompt_token_ids"] = reply.prompt_ids
        message["token_ids"] = reply.completion_ids
    return message


def message_events(message: dict[str, Any]) -> list[bytes]:
    """A whole `message` as the server-sent events of a streamed one.

    `message_start` (no content yet), each content block started, its text or input JSON as one
    delta, stopped, then `message_delta` with the `stop_reason` and usage, and `message_stop`.
    """
    usage = message["usage"]
    started = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {**usage, "output_tokens": 0},
    }
    events: list[dict[str, Any]] = [{"type": "message_start", "message": started}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            start = {**block, "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            {"type": "content_block_start", "index": index, "content_block": start},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]
    events += [
        {"type": "message_delta", "usage": {"output_tokens": usage["output_tokens"]},
         "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None}},
        {"type": "message_stop"},
    ]  # fmt: skip
    return [sse(event["type"], event) for event in events]


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """An error body in Anthropic's form, its `type` following the status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_client(
    client: openai.OpenAI | openai.AsyncOpenAI,
) -> anthropic.Anthropic | anthropic.AsyncAnthropic:
    """An `anthropic` client for the session an agent's OpenAI `client` reaches.

    An agent is handed an `openai.AsyncOpenAI` (or `openai.OpenAI`); one that speaks the Messages
    API asks for `anthropic_client(client)`: an `anthropic.AsyncAnthropic` (or
    `anthropic.Anthropic`) with the same session URL, no retries (a refused request is an answer).

    Raises:
        ImportError: The `anthropic` package is missing (`pip install 'agentgrpo[agents]'`).
    """
    import anthropic
    import openai

    base_url = str(client.base_url).rstrip("/").removesuffix("/v1")
    kind = (
        anthropic.AsyncAnthropic if isinstance(client, openai.AsyncOpenAI) else anthropic.Anthropic
    )
    return kind(base_url=base_url, api_key="agentgrpo", max_retries=0)
