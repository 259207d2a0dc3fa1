"""Rows that carry their own tools: function-calling datasets (BFCL, xLAM, ToolACE).

A row with a ``tools`` column plays with those tools shown to the model beside the run's own
(plain, MCP and environment tools). The column holds a list of schemas, each either OpenAI's
``{"type": "function", "function": {"name", "description", "parameters"}}`` or the bare
``{"name", "description", "parameters"}`` of BFCL and xLAM, or that list as a JSON string (as
datasets often store it). BFCL's type names (``dict``, ``float``, ``tuple``, ``any``...) become
JSON schema's (``object``, ``number``, ``array``, ``string``).

A row tool named like one of the run's tools calls the run's implementation (its schema, the
row's, is what the model reads). Any other row tool has no implementation: a call to it is
checked against its schema like any call, recorded in the episode (`Episode.tool_calls`) and
answered with its arguments as JSON (`placeholder_tool`), so reward functions score the calls
(`agentgrpo.rewards.tool_call_match`). A row with tools may also set ``max_turns``, a positive
int that replaces `EpisodeConfig.max_turns` for its episodes: ``1`` ends each one after its
first turn's calls (BFCL's single-turn tasks, where the calls are the answer; the episode
finishes with MAX_TURNS).

The renderer and parser of the row's tools are built once per distinct set of tools and turn
limit (`RowContexts`), so the members of a group, and rows that share tools, share them.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from rollout.episode import EpisodeContext
from rollout.parsers import Parser
from rollout.prompts import show_row
from rollout.template import ChatRenderer
from tools import Tool

#: The row column that holds a row's tool schemas.
TOOLS_COLUMN = "tools"
#: The column of a row with tools that may set its episodes' `max_turns`.
TURNS_COLUMN = "max_turns"

# BFCL's (Java- and Python-flavoured) type names and the JSON schema types they stand for.
_JSON_TYPES = {
    "dict": "object",
    "float": "number",
    "double": "number",
    "tuple": "array",
    "list": "array",
    "bool": "boolean",
    "any": "string",
}
_CACHED_CONTEXTS = 256  # distinct tool sets kept; a dataset with more rebuilds the oldest


class RowToolsError(ValueError):
    """A row's ``tools`` (or ``max_turns``) column is not what `rollout.row_tools` reads."""


def carries_tools(row: Mapping[str, Any]) -> bool:
    """Whether `row` has a ``tools`` column with a value (None is no tools)."""
    return row.get(TOOLS_COLUMN) is not None


def row_schemas(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The row's tool schemas in OpenAI's shape, BFCL's type names made JSON schema's.

    Raises:
        RowToolsError: The column is not a list of schemas (or its JSON), a schema has no
            name, or two share a name; the message shows the row and what works.
    """
    value = row[TOOLS_COLUMN]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise _error(row, f"its JSON does not parse ({error})") from None
    if not isinstance(value, list) or not all(isinstance(s, Mapping) for s in value):
        raise _error(row, f"it is a {type(value).__name__}, not a list of schemas")
    schemas = [_openai_schema(row, schema) for schema in value]
    names = [s["function"]["name"] for s in schemas]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise _error(row, f"tools {twice} appear twice; give each tool one schema")
    return schemas


def row_turn_limit(row: Mapping[str, Any]) -> int | None:
    """The row's ``max_turns`` (None: the run's `EpisodeConfig.max_turns`).

    Raises:
        RowToolsError: It is not a positive int.
    """
    turns = row.get(TURNS_COLUMN)
    if turns is not None and (type(turns) is not int or turns < 1):
        raise RowToolsError(
            f"a row's {TURNS_COLUMN!r} column must be a positive int (1: the episode ends "
            f"after its first turn's calls) or None, not {turns!r}. Row: {show_row(row)}"
        )
    return turns


def placeholder_tool(schema: Mapping[str, Any]) -> Tool:
    """A tool with `schema` and no implementation: its result is its arguments as JSON.

    `tools.call_tool` checks the arguments against the schema first, as for any tool.
    """
    name = schema["function"]["name"]

    def recorded(**arguments: Any) -> str:
        return json.dumps(arguments, ensure_ascii=False)

    return Tool(name, dict(schema), recorded)


class RowContexts:
    """The episode contexts of rows with tools, one per base context, tool set and turn limit.

    Args:
        parser_for: Tool schemas to the parser that reads calls to them (the run's parser
            option, `rollout.engine.select_parser`).
    """

    def __init__(self, parser_for: Callable[[list[dict[str, Any]]], Parser]):
        self.parser_for = parser_for
        self._cache: OrderedDict[tuple[int, str, int | None], EpisodeContext] = OrderedDict()

    def context(self, base: EpisodeContext, row: Mapping[str, Any]) -> EpisodeContext:
        """`base` for a row without tools; else `base` with the row's tools (module docstring).

        Raises:
            RowToolsError: The row's ``tools`` or ``max_turns`` is malformed.
            ToolTemplateError: The chat template cannot show tools.
        """
        if not carries_tools(row):
            return base
        schemas, turns = row_schemas(row), row_turn_limit(row)
        key = (id(base), json.dumps(schemas, sort_keys=True), turns)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        context = self._build(base, schemas, turns)
        self._cache[key] = context
        if len(self._cache) > _CACHED_CONTEXTS:
            self._cache.popitem(last=False)
        return context

    def _build(
        self, base: EpisodeContext, schemas: list[dict[str, Any]], turns: int | None
    ) -> EpisodeContext:
        """`base` showing the run's tools the row does not name, then the row's."""
        run_tools = {**base.tools, **base.environment_tools}
        named = {s["function"]["name"] for s in schemas}
        shown = [t.schema for name, t in run_tools.items() if name not in named] + schemas
        placeholders = {
            s["function"]["name"]: placeholder_tool(s)
            for s in schemas
            if s["function"]["name"] not in run_tools
        }
        old = base.renderer
        renderer = ChatRenderer(
            old.tokenizer,
            old.template,
            shown,
            old.template_kwargs,
            processor=old.processor,
            limits=old.limits,
        )
        renderer.check_tool_support()
        config = base.config if turns is None else dataclasses.replace(base.config, max_turns=turns)
        return dataclasses.replace(
            base,
            renderer=renderer,
            parser=self.parser_for(shown),
            config=config,
            tools={**base.tools, **placeholders},
        )


def _openai_schema(row: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """One schema in OpenAI's shape (a bare one wrapped), BFCL's types renamed."""
    function = schema.get("function") if schema.get("type") == "function" else schema
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise _error(row, f"the schema {_short(schema)} names no function")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise _error(row, f"{function['name']!r} has parameters that are not an object schema")
    out = {key: value for key, value in function.items() if key != "parameters"}
    out["parameters"] = _json_types(parameters or {"type": "object", "properties": {}})
    return {"type": "function", "function": out}


def _json_types(schema: Any) -> Any:
    """`schema` with BFCL's type names made JSON schema's, at every depth."""
    if isinstance(schema, list):
        return [_json_types(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: _json_types(value) for key, value in schema.items()}
    kind = schema.get("type")
    if isinstance(kind, str):
        out["type"] = _JSON_TYPES.get(kind, kind)
    elif isinstance(kind, list):
        out["type"] = [_JSON_TYPES.get(k, k) if isinstance(k, str) else k for k in kind]
    return out


def _error(row: Mapping[str, Any], problem: str) -> RowToolsError:
    return RowToolsError(
        f"this row's {TOOLS_COLUMN!r} column cannot be read: {problem}. It takes a list of "
        'tool schemas, each {"type": "function", "function": {"name", "description", '
        '"parameters"}} or a bare {"name", "description", "parameters"} (BFCL, xLAM), or '
        f"that list as a JSON string. Row: {show_row(row)}"
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
