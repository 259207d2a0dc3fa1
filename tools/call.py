"""Call a tool the way the model asked, turning every failure the model caused into data.

Contract of `call_tool`:

- It never raises for a failure the model caused: an unknown tool name, arguments that do not
  match the schema, an exception inside the tool, or a timeout. Each becomes a `ToolResult`
  with `error` set and `content` an error message written for the model to read and correct
  itself. "An exception" is anything the tool raises, `SystemExit` and `KeyboardInterrupt`
  included: a tool's failure is never a signal to the framework. What does propagate is
  anyio's cancellation from outside, a `KeyboardInterrupt` on the main thread (a real Ctrl-C;
  see `tools.threads.is_signal`), `StuckCallsError` (too many of the user's sync tools
  ignore their timeout), `SandboxUnavailableError` (the python tool cannot isolate here),
  `InfrastructureError` (the machinery behind the tool failed, not the model: the episode is
  replayed, see `tools.infrastructure`) and `ToolResultError` (a tool's value cannot become
  text; see below).
- Arguments are checked against the schema's `parameters` before the call: required ones are
  present, no unknown ones, and each value has its JSON type (see `_coerce`). Integral floats
  given for an `integer` become `int`; arrays given for a `tuple[...]` hint become tuples.
- Sync tools run in a daemon thread (`tools.threads.run_in_daemon_thread`), so a hung sync tool
  never blocks the event loop; on timeout its thread is abandoned, not killed, and keeps
  running until the function returns, but never keeps the process alive at exit. Async tools
  are awaited. Both run under `anyio.fail_after(timeout_s)` when `timeout_s` is not None.
- The value returned becomes `content`: `str` as is, `None` as `""`, dict/list/tuple as JSON,
  anything else with `str()`. An int too long to write out (past Python's 4,300 digits, which
  the model's arguments can reach), alone or inside a dict, list or tuple, becomes a note that
  says so: that is data too. A value that cannot become text (e.g. a dict with tuple keys) is
  the tool author's bug, not the model's: `ToolResultError` names the tool's function.
- A `Rewarded(value, reward)` gives the step a reward (`ToolResult.reward`; `tools.rewarded`):
  the model reads only `value`; a reward that is not a finite number is a `ToolRewardError`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import anyio

from tools.infrastructure import InfrastructureError
from tools.rewarded import split_reward
from tools.sandbox import SandboxUnavailableError
from tools.schema import Tool
from tools.threads import StuckCallsError, describe_error, is_signal, run_in_daemon_thread

_JSON_NOUNS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "a boolean",
    "array": "an array",
    "object": "an object",
    "null": "null",
}
_MAX_SHOWN_CHARS = 80  # how much of a bad value the error message quotes back
# What a tool may raise that is no failure of the model's, so never a message to it.
_NOT_THE_MODELS = (StuckCallsError, SandboxUnavailableError, InfrastructureError)


class ToolErrorKind(StrEnum):
    """Why a tool call failed; `ToolResult.error` is None when it did not."""

    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    EXCEPTION = "exception"
    TIMEOUT = "timeout"
    BAD_PICTURE = "bad_picture"


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call, ready to become a tool message.

    Attributes:
        name: The tool name the model asked for (even when no such tool exists).
        content: The tool's output as text, or an error message for the model when `error`
            is set.
        error: Why the call failed, or None if it succeeded.
        seconds: Wall time of the whole call, validation included, in seconds.
        images: Images the tool returned (PIL images, `is_image`), for a vision-language model
            to see after `content`'s text; empty for text results.
        reward: What the step earned: the reward of a `Rewarded` the tool returned, else 0.0.

    """

    name: str
    content: str
    error: ToolErrorKind | None
    seconds: float
    images: tuple[Any, ...] = ()
    reward: float = 0.0


async def call_tool(
    tools: Mapping[str, Tool],
    name: str,
    arguments: Mapping[str, Any],
    timeout_s: float | None,
) -> ToolResult:
    """Validate the arguments, call the tool under a timeout, and return its result as text.

    A tool may also return an image (a PIL image), or a list or tuple of images and other
    values: the images go to `ToolResult.images`, the other values, as text, one a line, to
    `content`. A `Rewarded(value, reward)` is read as `value`, its reward is `ToolResult.reward`.

    Args:
        tools: The tools the model may call, by name.
        name: The tool name the model asked for.
        arguments: The arguments the model gave, already parsed from JSON.
        timeout_s: Wall-clock limit for the tool in seconds; None for no limit.

    Returns:
        The result; `error` is set (and `content` explains it to the model) on any failure
        the model caused. Never raises for those.

    Raises:
        ToolResultError: The tool returned a value that cannot become text (its author's bug).
        ToolRewardError: The tool returned a `Rewarded` with a reward that is not a finite
            number, or nested one (its author's bug).
        StuckCallsError: Too many calls of user code are stuck to start another.
        SandboxUnavailableError: The python tool cannot isolate its code here.
        InfrastructureError: The tool raised it: its sandbox or server failed, not the model.

    """
    start_s = time.perf_counter()

    def result(content: str, error: ToolErrorKind | None = None) -> ToolResult:
        return ToolResult(name, content, error, time.perf_counter() - start_s)

    tool = tools.get(name)
    if tool is None:
        return result(_unknown_tool_message(name, list(tools)), ToolErrorKind.UNKNOWN_TOOL)
    problems, kwargs = _check_arguments(tool, arguments)
    if problems:
        return result("\n".join(problems), ToolErrorKind.BAD_ARGUMENTS)
    scope = None
    try:
        with anyio.fail_after(timeout_s) as scope:
            value = await _invoke(tool, kwargs)
    except BaseException as exc:
        if isinstance(exc, _NOT_THE_MODELS) or is_signal(exc):
            raise
        if isinstance(exc, TimeoutError) and scope is not None and scope.cancelled_caught:
            message = f"Error: {name}() timed out after {float(timeout_s or 0)} s"
            return result(message, ToolErrorKind.TIMEOUT)
        return result(f"Error: {name}() raised {describe_error(exc)}", ToolErrorKind.EXCEPTION)
    value, reward = split_reward(value, getattr(tool.fn, "__qualname__", tool.name))
    images = _images_in(value)
    if not images:
        text = _result_text(tool, value)
        return ToolResult(name, text, None, time.perf_counter() - start_s, (), reward)
    if problem := next(filter(None, map(picture_problem, images)), None):
        return result(f"Error: {name}() returned {problem}", ToolErrorKind.BAD_PICTURE)
    rest = [] if is_image(value) else [v for v in value if not is_image(v)]
    text = "\n".join(_result_text(tool, v) for v in rest)
    return ToolResult(name, text, None, time.perf_counter() - start_s, images, reward)


def is_image(value: Any) -> bool:
    """Whether `value` is a PIL image (checked by type, so PIL need not be installed)."""
    return any(
        cls.__name__ == "Image" and cls.__module__.startswith("PIL.") for cls in type(value).__mro__
    )


# The most pixels a picture may have: 4096 x 4096. A processor resizes larger ones anyway
# (Qwen2-VL's to at most 3584 x 3584), after holding them whole: a 12000 x 12000 picture took
# 7.9 s and 2.5 GB for one episode.
MAX_PICTURE_PIXELS = 4096 * 4096

# What to give instead of a picture that cannot be shown (`tools.picture_problem`).
PICTURES_ARE_PIL = (
    f"give PIL images of at most {MAX_PICTURE_PIXELS:,} pixels (a datasets Image() column "
    "decodes to them: `dataset.cast_column('image', datasets.Image())` loads a column of local "
    "paths)"
)


def picture_problem(value: Any) -> str | None:
    """Why `value` cannot be shown to a model, or None for a PIL image it can be shown.

    Not a PIL image (a path or a URL is never opened or fetched), no pixels (an image processor
    divides by its sides), or more than `MAX_PICTURE_PIXELS`.

    >>> picture_problem("https://example.com/cat.png")
    "a str ('https://example.com/cat.png'), not a PIL image"
    """
    if not is_image(value):
        return f"a {type(value).__name__} ({str(value)[:80]!r}), not a PIL image"
    width, height = value.size
    if width * height == 0:
        return f"a {width}x{height} picture, which has no pixels"
    if width * height > MAX_PICTURE_PIXELS:
        return (
            f"a {width}x{height} picture, over the {MAX_PICTURE_PIXELS:,} pixels a picture may "
            "have; make it smaller"
        )
    return None


def _images_in(value: Any) -> tuple[Any, ...]:
    """The images a tool returned: the value itself, or the images of a list or tuple."""
    if is_image(value):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(v for v in value if is_image(v))
    return ()


async def _invoke(tool: Tool, kwargs: dict[str, Any]) -> Any:
    """Await an async tool; run a sync one in a daemon thread the timeout can abandon."""
    if inspect.iscoroutinefunction(tool.fn):
        return await tool.fn(**kwargs)
    value = await run_in_daemon_thread(
        functools.partial(tool.fn, **kwargs), label=f"tool {tool.name}()"
    )
    if inspect.isawaitable(value):  # e.g. a partial or lambda wrapping an async function
        value = await value
    return value


class ToolResultError(TypeError):
    """A tool returned a value that cannot become the text of its tool message (the user's bug)."""


# The most bits of an int str() always writes out (Python refuses more than 4,300 digits).
_LONGEST_INT_BITS = 14_000


def _result_text(tool: Tool, value: Any) -> str:
    """`_to_text(value)`, or a `ToolResultError` naming the tool's function when it fails."""
    try:
        return _to_text(value)
    except Exception as error:
        where = getattr(tool.fn, "__qualname__", tool.name)
        raise ToolResultError(
            f"tool {where}() returned a {type(value).__name__} that cannot become the text of its "
            f"tool message ({describe_error(error)}); return str, None, or data that JSON can "
            "encode (with string keys)"
        ) from error


def _to_text(value: Any) -> str:
    """Render a tool's return value as the text of the tool message."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, dict | list | tuple):
        return _json_text(value)
    if _is_huge_int(value):
        return _huge_int_note(value)
    return str(value)


def _json_text(value: dict | list | tuple) -> str:
    """`value` as JSON; an int too long to write out, at any depth, becomes its note.

    Only a value that fails is walked (`_writable`), so plain results cost one `json.dumps`.
    What still fails (a tuple key, a container inside itself) raises as `json.dumps` does.
    """
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except ValueError:
        return json.dumps(_writable(value, frozenset()), ensure_ascii=False, default=str)


def _writable(value: Any, enclosing: frozenset[int]) -> Any:
    """A copy of `value` with each int too long to write out, in dicts, lists and tuples, a note.

    `enclosing` holds the ids of the containers `value` is inside, so that a container inside
    itself raises `ValueError` as `json.dumps` does, rather than recursing for ever.
    """
    if _is_huge_int(value):
        return _huge_int_note(value)
    if not isinstance(value, dict | list | tuple):
        return value
    if id(value) in enclosing:
        raise ValueError("Circular reference detected")
    inside = enclosing | {id(value)}
    if isinstance(value, dict):
        return {
            _huge_int_note(k) if _is_huge_int(k) else k: _writable(v, inside)
            for k, v in value.items()
        }
    return [_writable(v, inside) for v in value]


def _is_huge_int(value: Any) -> bool:
    """Whether `value` is an int past Python's 4,300-digit limit, where str() raises.

    The model's arguments can get there (a product of two long numbers): that is data.
    """
    return isinstance(value, int) and abs(value).bit_length() > _LONGEST_INT_BITS


def _huge_int_note(value: int) -> str:
    """What the model reads in place of an int too long to write out."""
    digits = int(abs(value).bit_length() * math.log10(2)) + 1
    return f"an integer of about {digits} digits, too long to write out"


def _unknown_tool_message(name: str, available: list[str]) -> str:
    """Tell the model the tool does not exist, the nearest name, and what does exist."""
    message = f"Error: unknown tool {name!r}."
    close = difflib.get_close_matches(str(name), available, n=1)
    if close:
        message += f" Did you mean {close[0]!r}?"
    return message + f" Available tools: {', '.join(available) or 'none'}."


def call_problems(tools: Mapping[str, Tool], name: Any, arguments: Any) -> list[str]:
    """What `call_tool` would tell the model about this call before running it; [] if nothing.

    For checking calls written by hand (demonstrations) as the model's are checked.
    """
    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None:
        return [_unknown_tool_message(str(name), list(tools))]
    return _check_arguments(tool, arguments)[0]


def _check_arguments(tool: Tool, arguments: Any) -> tuple[list[str], dict[str, Any]]:
    """Check `arguments` against the tool's schema; return (problems, arguments to pass)."""
    head = f"Error: {tool.name}()"
    if not isinstance(arguments, Mapping):
        return [f"{head} arguments must be a JSON object, got {_show(arguments)}."], {}
    parameters = tool.schema.get("function", {}).get("parameters") or {}
    properties = parameters.get("properties")
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for arg in parameters.get("required", []):
        if arg not in arguments:
            expected = _describe(properties.get(arg, {}) if properties else {}, article=False)
            problems.append(f"{head} is missing required argument {arg!r} ({expected}).")
    for arg, value in arguments.items():
        if properties is not None and arg not in properties:
            close = difflib.get_close_matches(str(arg), list(properties), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"{head} got unexpected argument {arg!r}.{hint}")
            continue
        try:
            kwargs[arg] = _coerce(value, (properties or {}).get(arg, {}), repr(arg))
        except _Mismatch as mismatch:
            problems.append(f"{head} argument {mismatch}.")
    return problems, kwargs


class _Mismatch(Exception):
    """A value does not have the JSON type its schema asks for; the message says how."""


def _coerce(value: Any, schema: Mapping[str, Any], where: str) -> Any:
    """Return `value` if it fits `schema` (integral floats made int), else raise `_Mismatch`.

    Checks `type` (a name or a list of names), `nullable`, `anyOf`, `enum`, and recursively
    `items`, `prefixItems` and `additionalProperties`. Anything else in the schema, and any
    type name not listed in `_JSON_NOUNS` (e.g. "image"), is accepted unchecked.
    """
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        value = _coerce_any_of(value, schema, where)
    elif "type" in schema:
        value = _coerce_type(value, schema, where)
    if "enum" in schema and not any(_same_json(value, option) for option in schema["enum"]):
        options = ", ".join(json.dumps(option) for option in schema["enum"])
        raise _Mismatch(f"{where} must be one of {options}, got {_show(value)}")
    return value


def _coerce_any_of(value: Any, schema: Mapping[str, Any], where: str) -> Any:
    """Return `value` coerced by the first `anyOf` branch it fits."""
    for branch in schema["anyOf"]:
        try:
            return _coerce(value, branch, where)
        except _Mismatch:
            continue
    raise _Mismatch(f"{where} must be {_describe(schema)}, got {_show(value)}")


def _coerce_type(value: Any, schema: Mapping[str, Any], where: str) -> Any:
    """Return `value` coerced to the first of the schema's `type` names it fits."""
    names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if any(type_name not in _JSON_NOUNS for type_name in names):
        return value  # a type we do not check ("image", "audio", ...): accept it
    for type_name in names:
        if _fits(value, type_name):
            return _coerce_inside(value, type_name, schema, where)
    raise _Mismatch(f"{where} must be {_describe(schema)}, got {_show(value)}")


def _fits(value: Any, type_name: str) -> bool:
    """Whether `value`, as parsed from JSON, has the JSON type `type_name`."""
    match type_name:
        case "integer":
            is_integral_float = isinstance(value, float) and value.is_integer()
            return (isinstance(value, int) and not isinstance(value, bool)) or is_integral_float
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
        case "string":
            return isinstance(value, str)
        case "boolean":
            return isinstance(value, bool)
        case "array":
            return isinstance(value, list | tuple)
        case "object":
            return isinstance(value, Mapping)
        case _:  # "null"
            return value is None


def _coerce_inside(value: Any, type_name: str, schema: Mapping[str, Any], where: str) -> Any:
    """Coerce an integral float to int, and check the items of arrays and objects."""
    if type_name == "integer":
        return int(value)
    if type_name == "array" and "prefixItems" in schema:
        slots = schema["prefixItems"]
        if len(value) != len(slots):
            raise _Mismatch(f"{where} must have exactly {len(slots)} items, got {len(value)}")
        pairs = enumerate(zip(value, slots, strict=True))
        return tuple(_coerce(v, s, f"{where}[{i}]") for i, (v, s) in pairs)
    if type_name == "array" and "items" in schema:
        return [_coerce(v, schema["items"], f"{where}[{i}]") for i, v in enumerate(value)]
    if type_name == "object" and isinstance(schema.get("additionalProperties"), Mapping):
        item_schema = schema["additionalProperties"]
        return {k: _coerce(v, item_schema, f"{where}[{k!r}]") for k, v in value.items()}
    return value


def _same_json(value: Any, option: Any) -> bool:
    """Equality as JSON sees it: `true` is not `1`, but `1` is `1.0`."""
    return value == option and isinstance(value, bool) == isinstance(option, bool)


def _describe(schema: Mapping[str, Any], article: bool = True) -> str:
    """Say in words what a schema accepts: "an integer", "integer or null", ..."""
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(option) for option in schema["enum"])
    if "anyOf" in schema:
        parts = [_describe(branch, article) for branch in schema["anyOf"]]
    elif "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        parts = [_describe_type(type_name, schema, article) for type_name in names]
    else:
        parts = ["any value"]
    if schema.get("nullable") and "null" not in parts:
        parts.append("null")
    return " or ".join(parts)


def _describe_type(type_name: str, schema: Mapping[str, Any], article: bool) -> str:
    """One JSON type in words; an array says what its items must be."""
    words = _JSON_NOUNS.get(type_name, type_name) if article else type_name
    if type_name == "array" and "items" in schema:
        words += f" of {_describe(schema['items'], article=False)}"
    return words


def _show(value: Any) -> str:
    """Quote a bad value back to the model with its JSON type: `"3" (string)`."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return f"{text} ({_json_type_name(value)})"


def _json_type_name(value: Any) -> str:
    """The JSON type of a parsed value, or its Python type name if it is not JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number" if math.isfinite(value) else "non-finite number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__
