"""Turn a typed, docstringed callable into a `Tool` with an OpenAI-style JSON schema.

Contract:

- The schema comes from `transformers.utils.get_json_schema`, so a tool looks to the chat
  template exactly as it would in transformers: `{"type": "function", "function": {"name",
  "description", "parameters": {"type": "object", "properties", "required"}}}`.
- A tool is called with keyword arguments only, so `*args`, `**kwargs` and positional-only
  parameters are refused, as are unbound methods (their `self` would never be passed).
- Every problem the tool's author must fix raises `ToolDefinitionError` (a `TypeError`) whose
  message names the function and says what to change. This is a user error: it is loud, at
  definition time, never at call time.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# OpenAI's rule for function names; most chat templates and parsers assume it.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Hints `get_json_schema` maps to a JSON type. Anything else it silently calls "object",
# which would hand the tool a dict where it expects an instance of the class.
_LEAF_HINTS = (int, float, str, bool, type(None), list, tuple, dict, Any)
_CONTAINER_ORIGINS = (list, tuple, dict, typing.Union, types.UnionType)
_EMPTY = inspect.Parameter.empty


class ToolDefinitionError(TypeError):
    """A callable cannot be made into a tool; the message says what to fix."""


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with the JSON schema the chat template shows it.

    Attributes:
        name: The name the model calls it by; equals `schema["function"]["name"]`.
        schema: `{"type": "function", "function": {"name", "description", "parameters"}}`.
        fn: The callable, sync or async; called with keyword arguments only.

    """

    name: str
    schema: dict
    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        """Refuse a schema whose function name disagrees with `name`."""
        schema_name = self.schema.get("function", {}).get("name")
        if schema_name != self.name:
            raise ToolDefinitionError(
                f"Tool {self.name!r}: schema['function']['name'] is {schema_name!r}; "
                "it must equal the tool's name."
            )


def as_tool(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """Make a `Tool` from a typed function, async function or bound method.

    Every argument needs a type hint and a line in the docstring's `Args:` section; the
    docstring's first paragraph becomes the description the model reads.

    Args:
        fn: The callable. For a method, pass it bound to an instance (`as_tool(env.increment)`);
            its `self` does not appear in the schema.
        name: The name the model calls the tool by; defaults to `fn.__name__`.

    Returns:
        The tool, with its schema built by `transformers.utils.get_json_schema`.

    Raises:
        ToolDefinitionError: If `fn` lacks a docstring, a type hint or an argument
            description, takes `*args`/`**kwargs`, or has a hint with no JSON type.

    Examples:
        >>> def add(a: int, b: int) -> int:
        ...     '''Add two integers.
        ...
        ...     Args:
        ...         a: First addend.
        ...         b: Second addend.
        ...     '''
        ...     return a + b
        >>> as_tool(add).schema["function"]["name"]
        'add'
        >>> as_tool(add, name="plus").schema["function"]["parameters"]["required"]
        ['a', 'b']

    """
    # Imported here, not at the top: importing transformers is slow, and `import tools`
    # (hence `import agentgrpo`) should stay fast.
    from transformers.utils import get_json_schema

    label = _label(fn)
    if not callable(fn):
        raise ToolDefinitionError(
            f"as_tool({label}): expected a callable, got {type(fn).__name__}."
        )
    tool_name = name if name is not None else getattr(fn, "__name__", None)
    if tool_name is None or not _NAME_RE.match(tool_name):
        raise ToolDefinitionError(
            f"as_tool({label}): tool name {tool_name!r} is not usable; pass name=... made of "
            "1 to 64 letters, digits, '_' or '-'."
        )
    parameters = _check_signature(fn, label)
    _check_docstring(fn, label, parameters)
    try:
        schema = get_json_schema(fn)
    except Exception as exc:
        raise ToolDefinitionError(
            f"as_tool({label}): transformers could not build a JSON schema: {exc}"
        ) from exc
    schema["function"]["name"] = tool_name
    return Tool(name=tool_name, schema=schema, fn=fn)


def _label(fn: Any) -> str:
    """A name for `fn` in error messages: `Counter.increment`, `calculator`, ..."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _check_signature(fn: Callable[..., Any], label: str) -> list[str]:
    """Check that `fn` can be called with typed keyword arguments; return their names."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"as_tool({label}): cannot read its signature: {exc}") from exc
    params = list(signature.parameters.values())
    receiver = params and params[0].name in ("self", "cls") and params[0].annotation is _EMPTY
    if receiver and not inspect.ismethod(fn):
        raise ToolDefinitionError(
            f"as_tool({label}): this is an unbound method; pass it bound to an instance, "
            f"e.g. as_tool(env.{getattr(fn, '__name__', 'method')})."
        )
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(
                f"as_tool({label}): argument {param.name!r} is variadic ({param}); tools take "
                "named arguments only, so list each one explicitly."
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise ToolDefinitionError(
                f"as_tool({label}): argument {param.name!r} is positional-only; tools are "
                "called with keyword arguments, so remove the '/'."
            )
        if param.annotation is _EMPTY:
            raise ToolDefinitionError(
                f"as_tool({label}): argument {param.name!r} has no type hint; annotate it, "
                f"e.g. `{param.name}: int`."
            )
    _check_hints(fn, label, [p.name for p in params])
    return [p.name for p in params]


def _check_hints(fn: Callable[..., Any], label: str, names: list[str]) -> None:
    """Refuse hints that cannot be resolved or that have no JSON schema type."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise ToolDefinitionError(
            f"as_tool({label}): its type hints cannot be resolved ({exc}); make every name "
            "used in a hint importable from the function's module."
        ) from exc
    for arg in names:
        if not _is_json_hint(hints[arg]):
            raise ToolDefinitionError(
                f"as_tool({label}): argument {arg!r} has type hint {hints[arg]!r}, which has "
                "no JSON type; use int, float, str, bool, list[...], tuple[...], "
                "dict[str, ...], Literal[...] or a union of these."
            )


def _is_json_hint(hint: Any) -> bool:
    """Whether `get_json_schema` maps `hint` to a real JSON type (not a silent "object")."""
    origin = typing.get_origin(hint)
    if origin is None:
        return any(hint is leaf for leaf in _LEAF_HINTS)
    if origin is typing.Literal:
        return True
    if origin in _CONTAINER_ORIGINS:
        return all(arg is Ellipsis or _is_json_hint(arg) for arg in typing.get_args(hint))
    return False


def _check_docstring(fn: Callable[..., Any], label: str, names: list[str]) -> None:
    """Check the docstring has a summary and describes every argument in `Args:`."""
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ToolDefinitionError(
            f"as_tool({label}): it has no docstring; add a Google-style docstring with a "
            "one-line summary (the model reads it) and an `Args:` section describing each "
            "argument."
        )
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    summary, described, _ = parse_google_format_docstring(doc.strip())
    if not summary:
        raise ToolDefinitionError(
            f"as_tool({label}): its docstring has no summary before `Args:`; start it with "
            "one line saying what the tool does (the model reads it)."
        )
    missing = [arg for arg in names if arg not in (described or {})]
    if not missing:
        return
    if not re.search(r"^\s*Args:\s*$", doc, re.MULTILINE):
        raise ToolDefinitionError(
            f"as_tool({label}): its docstring has no `Args:` section; add one with a line "
            f"`name: description` for each of: {', '.join(missing)}."
        )
    arg = missing[0]
    hint = ""
    if re.search(rf"^\s*{re.escape(arg)}\s*\(", doc, re.MULTILINE):
        hint = f" Write `{arg}: description`; the `{arg} (type): ...` form is not read."
    raise ToolDefinitionError(
        f"as_tool({label}): argument {arg!r} is not described in the docstring's `Args:` "
        f"section; add a line `{arg}: <what it means>`.{hint}"
    )
