"""Checks and encodings the endpoint's wire formats share (chat completions, Responses, Messages).

Each format reads a JSON body into the `ChatRequest` a session answers; these helpers read its
fields, refusing a wrong type with a `RequestError` that names the field, and write server-sent
events.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rollout.agents.session import RequestError


def whole_number(body: Mapping[str, Any], name: str) -> int | None:
    """`body[name]`: None (absent or null) or a whole number >= 1; booleans are not numbers.

    >>> whole_number({"max_tokens": 5}, "max_tokens"), whole_number({}, "max_tokens")
    (5, None)

    Raises:
        RequestError: Anything else, named.
    """
    value = body.get(name)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise RequestError(f"'{name}' must be a whole number >= 1 or null, got {value!r}")


def string(item: Mapping[str, Any], key: str, where: str) -> str:
    """`item[key]`, which must be a string; else a `RequestError` naming `where.key`."""
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string, not {type(value).__name__}")
    return value


def flag(body: Mapping[str, Any], name: str) -> bool:
    """`body[name]` as a boolean: false when absent or null.

    Raises:
        RequestError: It holds something other than true, false or null.
    """
    value = body.get(name)
    if not isinstance(value, bool | None):
        raise RequestError(f"'{name}' must be true or false, got {value!r}")
    return bool(value)


def text_of(content: Any, kinds: tuple[str, ...], where: str) -> str:
    """The text of `content`: a string, or a list of text parts (`type` in `kinds`) joined.

    >>> text_of([{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
    ...         ("input_text",), "input[0].content")
    'ab'

    Raises:
        RequestError: Content of another kind (an image, say): only text reaches the template.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in kinds or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"{where}[{index}] is a {kind or type(part).__name__!r} part; only text "
                    f"parts ({', '.join(kinds)}) are supported"
                )
        return "".join(part["text"] for part in content)
    raise RequestError(f"{where} must be text (a string or a list of {kinds[0]} parts)")


def sse(event: str | None, data: Mapping[str, Any]) -> bytes:
    """One server-sent event: an `event:` line where the format names its events, then data."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def token_logprobs(tokens: list[str], logprobs: list[float]) -> list[dict[str, Any]]:
    """Each sampled token with its sampler logprob, in OpenAI's logprobs form."""
    return [
        {
            "token": token,
            "logprob": logprob,
            "bytes": list(token.encode("utf-8", "replace")),
            "top_logprobs": [],
        }
        for token, logprob in zip(tokens, logprobs, strict=True)
    ]


def arguments_json(arguments: Any) -> str:
    """A tool call's arguments as the JSON string OpenAI's formats carry."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
