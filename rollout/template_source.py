"""Where a chat template comes from, and how its jinja source is compiled.

`load_template` picks the source: the tokenizer's own template, a built-in one
(`BUILTIN_TEMPLATES`), or jinja text. `compile_template` compiles it in the sandbox of
`rollout.template_sandbox` with the conventions Hugging Face templates rely on (`trim_blocks`,
`lstrip_blocks`, a `tojson` filter that keeps non-ASCII text, `raise_exception`,
`strftime_now`, and the `{% generation %}` block, which renders its body).
`describe_template` names a template in error messages. `rollout.template` renders with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols

from rollout.template_sandbox import BoundedSandbox, TemplateRenderError

BUILTIN_TEMPLATES = {"chatml_tools": "chatml_tools.jinja", "chatml_vision": "chatml_vision.jinja"}

_PROBE_TOOL = "agentgrpo_probe_tool"
_PROBE_ARGUMENT = "agentgrpo_probe_argument"
_PROBE_RESULT = "agentgrpo_probe_result"

# A made-up tool, and a conversation that calls another tool: the schema's marker can only
# come from `tools=`, the argument's from the call, the result's from the tool message.
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_TOOL,
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {}},
    },
}
PROBE_MESSAGES = (
    {"role": "user", "content": "Probe."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {_PROBE_ARGUMENT: 1}}}
        ],
    },
    {"role": "tool", "name": "f", "content": _PROBE_RESULT},
)


class ToolTemplateError(ValueError):
    """The chat template cannot show tools, tool calls or tool results to the model."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; render its body."""

    tags = {"generation"}  # noqa: RUF012  (jinja reads this class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled; call it under `bounded` (jinja folds constant filters while compiling)."""
    env = BoundedSandbox(
        filters={"tojson": _tojson},
        globals={
            "raise_exception": _raise_exception,
            "strftime_now": lambda fmt: datetime.now().strftime(fmt),
        },
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationBlock],
    )
    return env.from_string(source)


@lru_cache(maxsize=len(BUILTIN_TEMPLATES))
def _builtin_source(name: str) -> str:
    files = resources.files("rollout") / "templates" / BUILTIN_TEMPLATES[name]
    return files.read_text(encoding="utf-8")


def describe_template(template: str, *owners: Any) -> str:
    """How errors name `template`, as the start of a sentence.

    A built-in by its name; the template of one of `owners` (a tokenizer or processor whose
    `chat_template` it is) by that one's model folder or hub id; other source by its start.
    """
    builtin = next((name for name in BUILTIN_TEMPLATES if template == _builtin_source(name)), None)
    if builtin is not None:
        return f"The built-in chat template {builtin!r}"
    for owner in owners:
        if owner is not None and template == getattr(owner, "chat_template", None):
            where = getattr(owner, "name_or_path", "") or type(owner).__name__
            return f"The chat template of {where!r} (tokenizer_config.json or chat_template.jinja)"
    return f"The chat template given as jinja source (starting {template[:40]!r})"


def load_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """Return the jinja source to render with.

    Args:
        tokenizer: A transformers tokenizer; its own `chat_template` is used when `chat_template`
            is None.
        chat_template: None, the name of a built-in template (`"chatml_tools"`: ChatML with
            Hermes-style tool calls, for ChatML models whose own template ignores tools, such as
            SmolLM2; `"chatml_vision"`: the same, with image content parts, for vision-language
            models, see `rollout.images`), or jinja source text.

    """
    if chat_template is None:
        if not getattr(tokenizer, "chat_template", None):
            raise ToolTemplateError(
                "The tokenizer has no chat template. Pass chat_template='chatml_tools' for a "
                "ChatML model, or the jinja source of a template that renders tools."
            )
        return tokenizer.chat_template
    if chat_template in BUILTIN_TEMPLATES:
        return _builtin_source(chat_template)
    if "{{" not in chat_template and "{%" not in chat_template:
        raise ValueError(
            f"chat_template={chat_template!r} is neither a built-in template "
            f"({', '.join(BUILTIN_TEMPLATES)}) nor jinja source."
        )
    return chat_template


def check_probe(render: Callable[[], str]) -> None:
    """Raise `ToolTemplateError` unless `render`'s text shows the probe's tool, call and result.

    `render` renders `PROBE_MESSAGES` with `PROBE_TOOL` among the tools: a template that
    silently drops any of them cannot teach a model to call tools.
    """
    try:
        text = render()
    except TemplateRenderError:  # its own message says what went wrong and what to do
        raise
    except Exception as error:  # template code fails any way: `str + dict` is a TypeError
        raise ToolTemplateError(
            f"The chat template fails on a conversation with a tool call "
            f"({type(error).__name__}: {error}). "
            f"Pass chat_template='chatml_tools' (for ChatML models) or a template with tool "
            f"support."
        ) from error
    missing = [
        what
        for what, marker in (
            ("the tool schemas (tools=)", _PROBE_TOOL),
            ("the assistant's tool calls", _PROBE_ARGUMENT),
            ("tool results", _PROBE_RESULT),
        )
        if marker not in text
    ]
    if missing:
        raise ToolTemplateError(
            f"The chat template drops {', '.join(missing)}, so the model would never see its "
            f"tools or their results. Pass chat_template='chatml_tools' (ChatML with "
            f"Hermes-style <tool_call> blocks, for ChatML models such as SmolLM2) or a "
            f"template that renders tools."
        )
