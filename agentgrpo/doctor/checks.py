"""The checks that need only a tokenizer and a template: tools render, calls parse, turns stop.

Each check takes a `Setup` (what a run renders, parses and stops with) and returns a
`CheckResult`; none raises on what it finds. They render a small probe conversation that calls
the run's first tool (or `PROBE_TOOL` when there is none) with arguments made up from its
schema, so a parser that reads values through the schema reads them as a run would.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout import PARSERS, ChatRenderer, ToolTemplateError
from rollout.engine import select_parser
from rollout.parsers import Parser

PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up in the dictionary.",
        "parameters": {
            "type": "object",
            "properties": {
                "word": {"type": "string", "description": "The word to look up."},
                "limit": {"type": "integer", "description": "The most entries to return."},
            },
            "required": ["word", "limit"],
        },
    },
}
"""The tool the probe conversation offers and calls when the run has no tools of its own."""

_SAMPLE_VALUES = {"string": "agent", "integer": 2, "number": 0.5, "boolean": True}
# Markup a template may wrap tool calls in: <tool_call>, <|python_tag|>, [TOOL_CALLS], ...
_MARKER = re.compile(r"<\|?/?[A-Za-z_][\w.:=-]*\|?>|\[[A-Z][A-Z_]+\]")


class Status(enum.Enum):
    """How a check came out: fine, worth knowing (the run works), or a run would fail."""

    OK = "ok"
    WARNING = "warning"
    FAIL = "fail"


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome.

    Attributes:
        name: The check, one word (`template`, `parser`, `history`, ...).
        status: ok, warning or fail.
        message: One line saying what was found.
        fix: What to do about it; empty when the status is ok.

    """

    name: str
    status: Status
    message: str
    fix: str = ""

    def line(self) -> str:
        """`status  name  message` and, for a problem, `fix: ...`, on one line."""
        text = f"{self.status.value:<8}{self.name:<12}{self.message}"
        return f"{text}  fix: {self.fix}" if self.fix else text


@dataclass(frozen=True)
class Setup:
    """What a run renders, parses and stops with.

    Attributes:
        tokenizer: The model's tokenizer.
        template: The chat template's jinja source (`rollout.load_template`).
        stop_token_ids: The ids generation stops on (the backend's `stop_token_ids`).
        tools: The run's tool schemas; empty means `PROBE_TOOL` stands in.
        tool_call_parser: A parser name, or None to choose as the engine does.
        parser: The parser itself, when already chosen (it wins over `tool_call_parser`).
        template_kwargs: Extra template variables (`chat_template_kwargs`).

    """

    tokenizer: Any
    template: str
    stop_token_ids: frozenset[int]
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_call_parser: str | None = None
    parser: Parser | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools the probe conversation offers."""
        return [dict(t) for t in self.tools] or [PROBE_TOOL]

    def renderer(self) -> ChatRenderer:
        """A renderer of the template with the probe's tools (raises on a broken template)."""
        return ChatRenderer(self.tokenizer, self.template, self.schemas, self.template_kwargs)

    def chosen_parser(self) -> Parser:
        """The parser, chosen as `RolloutEngine` chooses it (raises ValueError if it cannot)."""
        if self.parser is not None:
            return self.parser
        return select_parser(self.tool_call_parser, self.tokenizer, self.template, self.schemas)

    def stop_texts(self) -> dict[str, int]:
        """Each stop token's text, with its id."""
        return {self.tokenizer.decode([i]): i for i in sorted(self.stop_token_ids)}


def probe_call(schemas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A call of the first tool, with a made-up value of the right type for each parameter.

    >>> probe_call([PROBE_TOOL])["function"]
    {'name': 'lookup', 'arguments': {'word': 'agent', 'limit': 2}}
    """
    function = schemas[0].get("function", schemas[0])
    properties = (function.get("parameters") or {}).get("properties") or {}
    arguments = {name: _sample_value(spec) for name, spec in properties.items()}
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _sample_value(spec: Mapping[str, Any]) -> Any:
    if spec.get("enum"):
        return spec["enum"][0]
    kind = spec.get("type", "string")
    kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
    return _SAMPLE_VALUES.get(kind, [] if kind == "array" else {} if kind == "object" else "agent")


def assistant_turn(
    renderer: ChatRenderer, before: Sequence[Mapping[str, Any]], message: Mapping[str, Any]
) -> str:
    """The text the template writes for `message` after the generation prompt of `before`.

    This is what the model would have to sample for that turn, end-of-turn token included.
    """
    prompt = renderer.render(before, generation_prompt=True)
    full = renderer.render([*before, message], generation_prompt=False)
    return full[len(shared_prefix(prompt, full)) :]


def shared_prefix(a: str, b: str) -> str:
    """The longest text both `a` and `b` start with.

    >>> shared_prefix("<think>", "<tool_call>")
    '<t'
    """
    return os.path.commonprefix([a, b])  # noqa: RUF071  (characters are what we compare)


def check_template(setup: Setup) -> CheckResult:
    """Check 1: the template shows tool schemas, assistant tool calls and tool results."""
    try:
        setup.renderer().check_tool_support()
    except ToolTemplateError as error:
        return CheckResult("template", Status.FAIL, _first_sentence(error), _TEMPLATE_FIX)
    except Exception as error:  # a template that does not compile or render
        return CheckResult(
            "template", Status.FAIL, f"cannot render: {what_happened(error)}", _TEMPLATE_FIX
        )
    return CheckResult("template", Status.OK, "renders tool schemas, tool calls and tool results")


_TEMPLATE_FIX = (
    "pass --chat-template chatml_tools (ChatML models such as SmolLM2) or a template that "
    "renders tools, e.g. the model family's file from its hub repo"
)


def check_parser(setup: Setup) -> CheckResult:
    """Check 2: the parser reads back the call the template renders, and which markers it uses.

    The rendered turn is cut at the first stop token (the engine parses the sampled turn
    without it). Markers such as `<tool_call>` are reported as one token or as the pieces the
    tokenizer splits them into.
    """
    try:
        parser = setup.chosen_parser()
    except ValueError as error:
        return CheckResult("parser", Status.FAIL, what_happened(error), _PARSER_FIX)
    call = probe_call(setup.schemas)["function"]
    message = {"role": "assistant", "content": "", "tool_calls": [probe_call(setup.schemas)]}
    turn = assistant_turn(setup.renderer(), [_USER], message)
    text = _cut_at_stop(turn, setup.stop_texts())
    parsed = parser(text)
    got = [(c.name, dict(c.arguments)) for c in parsed.tool_calls]
    wanted = (call["name"], call["arguments"])
    label, markers = parser_label(parser), _markers(setup.tokenizer, text)
    if got == [wanted]:
        return CheckResult(
            "parser", Status.OK, f"{label} reads back {_show_call(*wanted)}{markers}"
        )
    if [(n, _as_text(a)) for n, a in got] == [(wanted[0], _as_text(wanted[1]))]:
        return CheckResult(
            "parser",
            Status.WARNING,
            f"{label} reads {_show_call(*got[0])} for {_show_call(*wanted)}: arguments as text",
            "tools receive strings where the schema says otherwise; pass the model's "
            "--tool-call-parser if it has one that reads values by the schema",
        )
    problem = "; ".join(parsed.errors) or f"reads {[_show_call(*g) for g in got]}"
    return CheckResult(
        "parser",
        Status.FAIL,
        f"{label} cannot read the call the template writes ({_quote(text)}): {problem}",
        _PARSER_FIX,
    )


_PARSER_FIX = (
    "pass --tool-call-parser NAME for the format the template writes (one of "
    f"{', '.join(sorted(PARSERS))}), or a template whose calls a parser reads"
)


def check_stop_tokens(setup: Setup) -> CheckResult:
    """Check 4: the token that ends an assistant turn in the template is a stop token.

    Both a tool-call turn and a plain answer are rendered; each must contain the text of one of
    `setup.stop_token_ids`, or generation would run past the end of the turn and the engine
    could not tell where the template's text resumes.
    """
    stops = setup.stop_texts()
    renderer = setup.renderer()
    calls = {"role": "assistant", "content": "", "tool_calls": [probe_call(setup.schemas)]}
    for kind, message in (("tool-call", calls), ("answer", _ANSWER)):
        turn = assistant_turn(renderer, [_USER], message)
        if not any(stop in turn for stop in stops):
            ending = _last_special_token(setup.tokenizer, turn)
            return CheckResult(
                "stop",
                Status.FAIL,
                f"the template ends an assistant {kind} turn with {ending}, which is not a "
                f"stop token of generation ({_show_ids(stops)})",
                "use a template whose assistant turns end with the model's end-of-turn token, "
                "or add that token's id to the model's generation_config.eos_token_id",
            )
    used = [stop for stop in stops if stop in turn]
    return CheckResult(
        "stop",
        Status.OK,
        f"assistant turns end with {_show_ids({s: stops[s] for s in used})}, a stop token",
    )


def parser_label(parser: Parser) -> str:
    """How a result names a parser: its `PARSERS` name, or where it comes from."""
    # A parser typed against the tool schemas is `functools.partial(PARSERS[name], tools=...)`.
    plain = getattr(parser, "func", parser)
    name = next((name for name, known in PARSERS.items() if known is plain), None)
    if name is not None:
        return f"parser {name}"
    if getattr(parser, "__qualname__", "").startswith("tokenizer_parser"):
        return "the tokenizer's response parser"
    return f"parser {getattr(parser, '__name__', type(parser).__name__)}"


_USER = {"role": "user", "content": "Look up 'agent'."}
_ANSWER = {"role": "assistant", "content": "An agent is one who acts."}


def _cut_at_stop(turn: str, stops: Mapping[str, int]) -> str:
    ends = [turn.find(stop) for stop in stops if stop in turn]
    return turn[: min(ends)] if ends else turn


def _markers(tokenizer: Any, text: str) -> str:
    """`; markers <tool_call> (1 token, id 5), </tool_call> (5 tokens)`, or '' if none."""
    notes = []
    for marker in dict.fromkeys(_MARKER.findall(text)):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        notes.append(
            f"{marker} ({'1 token, id ' + str(ids[0]) if len(ids) == 1 else f'{len(ids)} tokens'})"
        )
    return f"; markers {', '.join(notes)}" if notes else ""


def _last_special_token(tokenizer: Any, text: str) -> str:
    """The special token written last in `text` (quoted, with its id), or 'no special token'."""
    found = [
        (text.rfind(token.content), token.content, i)
        for i, token in tokenizer.added_tokens_decoder.items()
        if token.special and token.content in text
    ]
    if not found:
        return "no special token"
    _, content, token_id = max(found)
    return f"{content!r} (id {token_id})"


def _show_ids(texts: Mapping[str, int]) -> str:
    return ", ".join(f"{text!r} (id {i})" for text, i in texts.items())


def _show_call(name: str, arguments: Mapping[str, Any]) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


def _as_text(arguments: Mapping[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in arguments.items()}


def _quote(text: str, width: int = 60) -> str:
    """`text` as a short Python literal, cut with `...` past `width` characters."""
    return repr(text[:width]) + ("..." if len(text) > width else "")


def what_happened(error: BaseException) -> str:
    """`error`'s message, or its type's name where the message is empty (`TimeoutError()`).

    >>> what_happened(TimeoutError()), what_happened(ValueError("no rows"))
    ('TimeoutError', 'no rows')
    """
    return str(error) or type(error).__name__


def _first_sentence(error: Exception) -> str:
    text = what_happened(error)
    return text.split(". ", 1)[0].rstrip(".")


Check = Callable[[Setup], CheckResult]
