r"""Tool-call parsers: read the tool calls out of one assistant turn.

A `Parser` takes the decoded text of one assistant turn (the end-of-turn token already removed)
and returns a `ParsedTurn`: the text outside the calls, the calls it could read, and one error
message per call it could not. A parser never raises on what the model wrote: a bad call is
data (an error shown to the model in the tool turn), never an exception. Only the user's
mistakes raise: an unknown parser name, a template whose tool format cannot be told, an invalid
response template on a tokenizer.

JSON that no later stage could handle is a bad call too: nesting deeper than `MAX_JSON_DEPTH`,
an integer longer than Python converts (`sys.get_int_max_str_digits()`), or a string holding a
lone surrogate escape (`"\ud800"`), which no tokenizer encodes.

Two formats are written out here (`hermes`, `llama3_json`), the others in modules of their own
(`xml_style`: `qwen3_xml`, `glm4`, `atem`; `harmony`; `mistral`; `marked`: `deepseek_v3`,
`gemma4`, `lfm2`; what they share in `common`), all registered in `PARSERS`; `detect_parser`
tells from a chat template which one it asks for, and `tokenizer_parser` wraps the tokenizer's
own `parse_response` when it ships a response template.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout.parsers.common import MAX_JSON_DEPTH as MAX_JSON_DEPTH  # the limit every parser keeps
from rollout.parsers.common import (
    _BadCall,
    _decode,
    _error,
    _loads,
    _tool_call,
)
from rollout.parsers.harmony import parse_harmony
from rollout.parsers.marked import parse_deepseek_v3, parse_gemma4, parse_lfm2
from rollout.parsers.mistral import parse_mistral
from rollout.parsers.xml_style import parse_atem, parse_glm4, parse_qwen3_xml
from rollout.types import ParsedTurn, ToolCall

Parser = Callable[[str], ParsedTurn]

_HERMES_HINT = (
    'Write tool calls as <tool_call>{"name": "<tool name>", "arguments": {<JSON object>}}'
    "</tool_call>."
)
_LLAMA3_HINT = (
    'Write the whole turn as {"name": "<tool name>", "parameters": {<JSON object>}}; '
    'separate several calls with ";" or a newline.'
)
# A block runs to its closing tag, or to the end of the text when the model stopped inside it
# (group 2 is then empty).
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_LLAMA3_SEPARATOR = re.compile(r"[\s;]*")
_LLAMA3_NEXT_CALL = re.compile(r"[;\n]\s*(?=\{)")
# Llama 3 templates write the key in a Jinja string literal, so its quotes may be escaped.
_PARAMETERS_KEY = re.compile(r'\\?"parameters\\?"')


def parse_hermes(text: str) -> ParsedTurn:
    """Parse the Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    Any number of blocks may appear anywhere in the turn. Each block that is not a JSON object
    with a string `name` and an object `arguments` gives one entry in `errors`; the other blocks
    are still read. `arguments` may also be a JSON string encoding an object, may be called
    `parameters`, and may be left out (then it is `{}`). A `<tool_call>` left open at the end
    (the model stopped mid-call) is an error. `content` is the text with every block removed,
    stripped; tool calls keep the order in which they were written.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.

    Returns:
        The content, the tool calls, and one error message per block that could not be read.

    Examples:
        >>> text = 'Ok. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        >>> turn = parse_hermes(text)
        >>> turn.content, turn.tool_calls, turn.errors
        ('Ok.', [ToolCall(name='add', arguments={'a': 1})], [])
        >>> bad = parse_hermes('<tool_call>{"name": "add", "arguments": [1]}</tool_call>')
        >>> print(bad.errors[0])  # doctest: +NORMALIZE_WHITESPACE
        Error: could not parse tool call: "arguments" of 'add' must be a JSON object, got array.
        Write tool calls as
        <tool_call>{"name": "<tool name>", "arguments": {<JSON object>}}</tool_call>.

    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    outside: list[str] = []
    end = 0
    for block in _HERMES_BLOCK.finditer(text):
        outside.append(text[end : block.start()])
        end = block.end()
        if not block.group(2):
            errors.append(_error("the turn ended before </tool_call>", _HERMES_HINT))
            continue
        try:
            calls.append(_tool_call(_loads(block.group(1))))
        except _BadCall as exc:
            errors.append(_error(str(exc), _HERMES_HINT))
    outside.append(text[end:])
    return ParsedTurn(content="".join(outside).strip(), tool_calls=calls, errors=errors)


def parse_llama3_json(text: str) -> ParsedTurn:
    """Parse the Llama 3.1/3.2 JSON tool format: `{"name": ..., "parameters": {...}}`.

    The turn may start with `<|python_tag|>`. If, after stripping and removing that tag, it does
    not start with `{`, it is plain content with no tool calls (this includes Llama's built-in
    `<|python_tag|>code` calls, which are not JSON). Otherwise it is one or more JSON objects
    separated by `;` or whitespace, each read like a Hermes call (`parameters` or `arguments`,
    object or JSON string). An object that does not parse or has no name gives an error; reading
    resumes at the next `;` or newline followed by `{`. Text after the last object that does
    not start with `{` is returned as `content`; otherwise `content` is empty.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.

    Returns:
        The content, the tool calls, and one error message per object that could not be read.

    """
    body = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return ParsedTurn(content=text.strip())
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while body.startswith("{", pos):
        start = pos
        try:
            call, pos = _decode(body, start)
        except _BadCall as exc:  # not read to its end: resume at what looks like the next call
            errors.append(_error(str(exc), _LLAMA3_HINT))
            resume = _LLAMA3_NEXT_CALL.search(body, start + 1)
            pos = resume.end() if resume else len(body)
            continue
        try:
            calls.append(_tool_call(call))
        except _BadCall as exc:
            errors.append(_error(str(exc), _LLAMA3_HINT))
        separator = _LLAMA3_SEPARATOR.match(body, pos)
        assert separator is not None  # the pattern matches the empty string
        pos = separator.end()
    return ParsedTurn(content=body[pos:].strip(), tool_calls=calls, errors=errors)


PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "qwen3_xml": parse_qwen3_xml,
    "glm4": parse_glm4,
    "atem": parse_atem,
    "harmony": parse_harmony,
    "mistral": parse_mistral,
    "deepseek_v3": parse_deepseek_v3,
    "gemma4": parse_gemma4,
    "lfm2": parse_lfm2,
}


def _is_llama3(template: str) -> bool:
    return _PYTHON_TAG in template or (
        _PARAMETERS_KEY.search(template) is not None
        and ("ipython" in template or "<|eom_id|>" in template)
    )


# What a chat template holds when it asks for each parser's format. The XML formats write their
# calls inside <tool_call> too, so a bare <tool_call> means Hermes only without their markup.
_TEMPLATE_MARKERS: dict[str, Callable[[str], bool]] = {
    "hermes": lambda t: "<tool_call>" in t and "<function=" not in t and "<arg_key>" not in t,
    "llama3_json": _is_llama3,
    "qwen3_xml": lambda t: "<function=" in t,
    "glm4": lambda t: "<arg_key>" in t,
    "atem": lambda t: "<atem:invoke" in t,
    "harmony": lambda t: "<|channel|>" in t and "<|call|>" in t,
    "mistral": lambda t: "[TOOL_CALLS]" in t,
    "deepseek_v3": lambda t: "<｜tool▁call▁begin｜>" in t,
    "gemma4": lambda t: "<|tool_call>call:" in t,
    "lfm2": lambda t: "<|tool_call_start|>" in t,
}


def get_parser(name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> Parser:
    """Return the parser registered under `name` in `PARSERS`.

    Args:
        name: A key of `PARSERS`.
        tools: The tool schemas offered. Parsers of formats whose argument values are untyped
            text (`qwen3_xml`, `glm4`, `atem`) type each value against its parameter's schema
            (`"7"` becomes `7` for an integer); the others ignore them.

    Raises:
        ValueError: If no parser has that name; the message lists the valid names.

    """
    try:
        parser = PARSERS[name]
    except KeyError:
        valid = ", ".join(repr(known) for known in sorted(PARSERS))
        raise ValueError(f"unknown tool_call_parser {name!r}; valid names: {valid}") from None
    if tools is not None and "tools" in inspect.signature(parser).parameters:
        typed: Callable[..., ParsedTurn] = parser  # it takes `tools` too, as checked
        return functools.partial(typed, tools=list(tools))
    return parser


def detect_parser(chat_template: str) -> str:
    """Return the name of the parser that reads the tool calls a chat template asks for.

    Conservative: the template must hold the markup of exactly one format
    (`_TEMPLATE_MARKERS`): `"hermes"` for `<tool_call>` (without the XML formats' markup),
    `"llama3_json"` for `<|python_tag|>` or a `"parameters"` key with `ipython` or
    `<|eom_id|>`, `"qwen3_xml"` for `<function=`, `"glm4"` for `<arg_key>`, `"atem"` for
    `<atem:invoke`, `"harmony"` for `<|channel|>` with `<|call|>`, `"mistral"` for
    `[TOOL_CALLS]`, `"deepseek_v3"` for `<｜tool▁call▁begin｜>`, `"gemma4"` for
    `<|tool_call>call:`, `"lfm2"` for `<|tool_call_start|>`. Anything else raises.

    Args:
        chat_template: The Jinja source of the chat template.

    Raises:
        TypeError: If `chat_template` is not a string (e.g. a dict of named templates).
        ValueError: If no format, or more than one, seems present; the message says to pass
            `tool_call_parser=...` explicitly.

    """
    if not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be the template source, got {type(chat_template)}")
    found = [name for name, holds in _TEMPLATE_MARKERS.items() if holds(chat_template)]
    if len(found) == 1:
        return found[0]
    what = f"the formats of {' and '.join(found)}" if found else "no tool format it knows"
    valid = ", ".join(repr(known) for known in sorted(PARSERS))
    raise ValueError(
        f"cannot tell how this chat template writes tool calls (found {what}). If the model "
        f"calls tools, pass tool_call_parser=... (one of {valid}); if the template has no tool "
        "support, use a chat template that does."
    )


def tokenizer_parser(tokenizer: Any, *, tools: Sequence[Any] | None = None) -> Parser | None:
    """Return a parser backed by `tokenizer.parse_response`, or None without a response template.

    The template is `tokenizer.response_template` (transformers 5.19), else the older
    `tokenizer.response_schema`; it is checked here, so a broken one fails now, not per turn.
    Each turn is parsed with an empty prefix: a template that pre-writes part of the assistant
    turn (an opening `<think>`, say) is not seen. Reasoning fields of the parsed message are
    dropped; `content` is the message's `content`. If parsing raises, the turn has no tool calls,
    its stripped text as `content` and the exception as its one error.

    Args:
        tokenizer: A transformers tokenizer (or anything with `parse_response`).
        tools: Tool schemas (or functions) as `apply_chat_template` takes them; when given and
            the installed transformers supports it, string arguments are cast to the schema's
            types (`"7"` becomes `7` for an integer parameter).

    """
    template = getattr(tokenizer, "response_template", None)
    template = template if template is not None else getattr(tokenizer, "response_schema", None)
    parse_response = getattr(tokenizer, "parse_response", None)
    if template is None or parse_response is None:
        return None
    _check_response_template(template)
    accepted = inspect.signature(parse_response).parameters
    options: dict[str, Any] = {"prefix": ""} if "prefix" in accepted else {}
    if tools is not None and "tools" in accepted:
        options["tools"] = list(tools)

    def parse(text: str) -> ParsedTurn:
        try:
            message = parse_response(text, **options)
        except Exception as exc:  # the template is checked; what fails now is the model's text
            return ParsedTurn(content=text.strip(), errors=[_error(" ".join(str(exc).split()))])
        return _turn_from_message(message)

    return parse


def _check_response_template(template: Any) -> None:
    try:
        from transformers.utils.chat_parsing.response_templates import load_response_template
    except ImportError:  # an older transformers (response_schema): nothing to check up front
        return
    try:
        load_response_template(template)
    except ValueError as exc:
        raise ValueError(f"the tokenizer's response_template is invalid: {exc}") from exc


def _turn_from_message(message: Mapping[str, Any]) -> ParsedTurn:
    """Convert a parsed assistant message dict (OpenAI shape) to a `ParsedTurn`.

    Each `tool_calls` entry is `{"function": {"name", "arguments"}}` or a bare `{"name",
    "arguments"}`; it is read like a Hermes call, so a bad one becomes an error.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    for entry in message.get("tool_calls") or []:
        call = entry.get("function", entry) if isinstance(entry, Mapping) else entry
        try:
            calls.append(_tool_call(call))
        except _BadCall as exc:
            errors.append(_error(str(exc)))
    content = message.get("content")
    content = content.strip() if isinstance(content, str) else ""
    return ParsedTurn(content=content, tool_calls=calls, errors=errors)
