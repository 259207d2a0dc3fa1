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

Formats written out by hand: `hermes`, `llama3_json`, and DeepSeek V3 (`deepseek_v3`), Gemma 4
(`gemma4`) and LFM2 (`lfm2`, Python call syntax read with `ast`, never run); `tokenizer_parser`
wraps the tokenizer's own `parse_response` when the tokenizer ships a response template.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
# Deeper JSON is refused: every later step (the template's `tojson`, logs, tools) recurses over
# it, and Python's recursion limit (1000 frames, shared with the caller's stack) must hold there.
MAX_JSON_DEPTH = 128
_TOO_DEEP = f"the JSON nests deeper than {MAX_JSON_DEPTH} levels"
_SURROGATE = re.compile("[\ud800-\udfff]")


class _BadCall(ValueError):
    """A tool call that cannot be read; the message says why, in words for the model."""


def _error(reason: str, hint: str = "") -> str:
    message = f"Error: could not parse tool call: {_escaped(reason).rstrip('.')}."
    return f"{message} {hint}" if hint else message


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), "number" if isinstance(value, int | float) else "value")


def _json_reason(exc: json.JSONDecodeError) -> str:
    return f"{exc.msg} at line {exc.lineno} column {exc.colno}"


def _json_int(digits: str) -> int:
    """Read a JSON integer literal; one too long for Python to convert is the model's mistake."""
    try:
        return int(digits)
    except ValueError:  # over sys.get_int_max_str_digits(): int() refuses it
        limit = sys.get_int_max_str_digits()
        raise _BadCall(f"an integer has {len(digits.lstrip('-'))} digits, over {limit}") from None


_DECODER = json.JSONDecoder(parse_int=_json_int)


def _decode(text: str, start: int = 0) -> tuple[Any, int]:
    """`raw_decode` one JSON value at `start`: the value and the index after it.

    Raises:
        _BadCall: The text is not JSON there, or is JSON no tool call may hold: nested too
            deep for the decoder, or an integer too long to convert.

    """
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        raise _BadCall(_json_reason(exc)) from None
    except RecursionError:  # nested far deeper than MAX_JSON_DEPTH: refused all the same
        raise _BadCall(_TOO_DEEP) from None


def _loads(text: str) -> Any:
    """Decode a whole JSON text (surrounding whitespace allowed), like `json.loads`."""
    text = text.strip()  # so a line number counts from the JSON's first line, as the model sees
    value, end = _decode(text)
    if end != len(text):
        raise _BadCall(_json_reason(json.JSONDecodeError("Extra data", text, end)))
    return value


def _check_json(value: Any) -> None:
    r"""Raise `_BadCall` if a decoded value nests too deep or holds a lone surrogate.

    A lone surrogate (`"\ud800"` unpaired) decodes to a string that is not valid Unicode: no
    tokenizer can encode it and no UTF-8 file can hold it. The walk is iterative, so it never
    recurses whatever the depth.
    """
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            if not item.isascii() and (bad := _SURROGATE.search(item)):
                raise _BadCall(
                    f"the string {_quoted(item)} holds a lone surrogate "
                    f"\\u{ord(bad.group()):04x}, which is not a Unicode character"
                )
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _BadCall(_TOO_DEEP)
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        pending.extend((child, depth + 1) for child in children)


def _quoted(text: str, width: int = 40) -> str:
    """A short quote of a string, as `_escaped`."""
    shown = _escaped(text[:width])
    return f'"{shown}..."' if len(text) > width else f'"{shown}"'


def _escaped(text: str) -> str:
    r"""`text` with its lone surrogates written as escapes (`\ud800`), so it can be encoded."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _arguments(call: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Return a call's arguments: `arguments`, else `parameters`; absent, null or "" mean {}."""
    key = "arguments" if "arguments" in call else "parameters"
    arguments = call.get(key)
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):  # OpenAI style: the arguments object encoded as a string
        try:
            arguments = _loads(arguments)
        except _BadCall as exc:
            raise _BadCall(f'"{key}" of {name!r} is a string that is not JSON') from exc
        _check_json(arguments)
    if not isinstance(arguments, Mapping):
        raise _BadCall(f'"{key}" of {name!r} must be a JSON object, got {_json_type(arguments)}')
    return dict(arguments)


def _tool_call(call: Any) -> ToolCall:
    """Read one decoded call `{"name": str, "arguments": {...}}`; raise `_BadCall` if it is not."""
    _check_json(call)
    if not isinstance(call, Mapping):
        raise _BadCall(f"expected a JSON object, got {_json_type(call)}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise _BadCall('the "name" field is missing or not a string')
    return ToolCall(name=name, arguments=_arguments(call, name))


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

    Example:
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


# DeepSeek V3, Gemma 4 and LFM2: formats with their own markers, each read block by block.

_CallsOrErrors = list[ToolCall | _BadCall]


def _read_blocks(
    text: str,
    block: re.Pattern[str],
    closing: str,
    read: Callable[[str], _CallsOrErrors],
    hint: str,
) -> ParsedTurn:
    """Read every block of a turn that `block` matches (group 1 the body, group 2 the closing).

    `read` turns a body into its calls, or a `_BadCall` in place of a call it cannot read, and
    raises `_BadCall` when the body as a whole cannot be read. A block left open when the turn
    ended (group 2 empty) is one error. `content` is the text outside the blocks, stripped.
    """
    outside: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    end = 0
    for match in block.finditer(text):
        outside.append(text[end : match.start()])
        end = match.end()
        try:
            if not match.group(2):
                raise _BadCall(f"the turn ended before {closing}")
            read_calls = read(match.group(1))
        except _BadCall as exc:
            read_calls = [exc]
        for call in read_calls:
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                errors.append(_error(str(call), hint))
    outside.append(text[end:])
    return ParsedTurn(content="".join(outside).strip(), tool_calls=calls, errors=errors)


_DEEPSEEK_CALL = "<｜tool▁call▁begin｜>"
_DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DEEPSEEK_END = "<｜tool▁call▁end｜>"
_DEEPSEEK_HINT = (
    f"Write tool calls as {_DEEPSEEK_CALL}function{_DEEPSEEK_SEP}<tool name>\\n```json\\n"
    "{<JSON object>}\\n```<｜tool▁call▁end｜>."
)
_DEEPSEEK_BLOCK = re.compile(r"<｜tool▁call▁begin｜>(.*?)(<｜tool▁call▁end｜>|\Z)", re.DOTALL)
_DEEPSEEK_FRAME = re.compile(r"<｜tool▁calls▁(?:begin|end)｜>")
# After the separator: the name on its own line, then the arguments in a ```json fence or bare.
_DEEPSEEK_BODY = re.compile(r"([^\s{`]*)\s*(?:```(?:json)?(.*)```|(.*))", re.DOTALL)


def _deepseek_call(body: str) -> _CallsOrErrors:
    kind, sep, rest = body.partition(_DEEPSEEK_SEP)
    if not sep:
        raise _BadCall(f"no {_DEEPSEEK_SEP} between the call type and the tool name")
    if kind.strip() not in ("function", ""):
        raise _BadCall(f'the call type is {_quoted(kind.strip())}, not "function"')
    parts = _DEEPSEEK_BODY.fullmatch(rest.strip())
    assert parts is not None  # every group may be empty
    name, fenced, bare = parts.groups()
    if not name:
        raise _BadCall(f"no tool name after {_DEEPSEEK_SEP}")
    arguments = _loads(fenced if fenced is not None else bare)
    return [_tool_call({"name": name, "arguments": arguments})]


def parse_deepseek_v3(text: str) -> ParsedTurn:
    r"""Parse the DeepSeek V3 / R1 format: one block per call between calls-begin/end markers.

    A call is `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a newline, the arguments as
    a JSON object in a ```json fence (a bare object is read too), and `<｜tool▁call▁end｜>`.
    The `<｜tool▁calls▁begin｜>` / `<｜tool▁calls▁end｜>` markers around the calls are dropped;
    the rest of the text outside the calls is `content`, stripped. Each block that cannot be
    read, or that the turn ended inside, gives one error; the other blocks are still read.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.

    Returns:
        The content, the tool calls, and one error message per block that could not be read.

    Example:
        >>> call = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1}\n```'
        >>> parse_deepseek_v3(f"Ok.<｜tool▁calls▁begin｜>{call}<｜tool▁call▁end｜>").tool_calls
        [ToolCall(name='add', arguments={'a': 1})]

    """
    turn = _read_blocks(text, _DEEPSEEK_BLOCK, _DEEPSEEK_END, _deepseek_call, _DEEPSEEK_HINT)
    content = _DEEPSEEK_FRAME.sub("", turn.content).strip()
    return ParsedTurn(content=content, tool_calls=turn.tool_calls, errors=turn.errors)


_GEMMA_QUOTE = '<|"|>'
_GEMMA_HINT = (
    "Write tool calls as <|tool_call>call:<tool name>{<key>:<value>,...}<tool_call|>, with "
    '<|"|> before and after each string.'
)
_GEMMA_BLOCK = re.compile(r"<\|tool_call>(.*?)(<tool_call\|>|\Z)", re.DOTALL)
_GEMMA_BARE = re.compile(r"[^,:{}\[\]]*")  # an unquoted key or value runs to the next mark
_GEMMA_INT = re.compile(r"-?\d+")
_GEMMA_FLOAT = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-?inf|nan")
_GEMMA_WORDS = {"true": True, "false": False, "null": None, "None": None}


class _GemmaReader:
    """Reads Gemma 4 argument values from `text`, from `pos` on.

    A value is `<|"|>text<|"|>`, `{key:value,...}` (keys bare or quoted), `[value,...]`, or
    bare: `true`, `false`, `null` (or `None`), a number. Raises `_BadCall` on anything else.
    """

    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def skip(self, mark: str) -> bool:
        """Step over `mark` (after any whitespace) if it comes next."""
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        if self.text.startswith(mark, self.pos):
            self.pos += len(mark)
            return True
        return False

    def expect(self, mark: str) -> None:
        if not self.skip(mark):
            raise _BadCall(f"expected {mark} at character {self.pos}")

    def value(self, depth: int) -> Any:
        """The value that starts here; `depth` counts the objects and arrays around it."""
        if depth > MAX_JSON_DEPTH:
            raise _BadCall(_TOO_DEEP)
        if self.skip(_GEMMA_QUOTE):
            return self.string()
        if self.skip("{"):
            return dict(self.items("}", lambda: self.entry(depth)))
        if self.skip("["):
            return self.items("]", lambda: self.value(depth + 1))
        return self.bare()

    def entry(self, depth: int) -> tuple[str, Any]:
        key = self.key()
        self.expect(":")
        return key, self.value(depth + 1)

    def items(self, closing: str, item: Callable[[], Any]) -> list[Any]:
        """What `item` reads, once per comma-separated item, up to and past `closing`."""
        found = []
        if not self.skip(closing):
            found.append(item())
            while not self.skip(closing):
                self.expect(",")
                found.append(item())
        return found

    def string(self) -> str:
        end = self.text.find(_GEMMA_QUOTE, self.pos)
        if end < 0:
            raise _BadCall(f"a string opened with {_GEMMA_QUOTE} is never closed")
        value, self.pos = self.text[self.pos : end], end + len(_GEMMA_QUOTE)
        return value

    def key(self) -> str:
        if self.skip(_GEMMA_QUOTE):
            return self.string()
        key = self.bare_text()
        if not key:
            raise _BadCall(f"expected a key at character {self.pos}")
        return key

    def bare_text(self) -> str:
        match = _GEMMA_BARE.match(self.text, self.pos)
        assert match is not None  # the pattern matches the empty string
        self.pos = match.end()
        return match.group().strip()

    def bare(self) -> Any:
        word = self.bare_text()
        if word in _GEMMA_WORDS:
            return _GEMMA_WORDS[word]
        if _GEMMA_INT.fullmatch(word):
            return _json_int(word)
        if _GEMMA_FLOAT.fullmatch(word):
            return float(word)
        raise _BadCall(f"{_quoted(word)} is not a value; write strings between {_GEMMA_QUOTE}")


def _gemma4_call(body: str) -> _CallsOrErrors:
    reader = _GemmaReader(body)
    reader.expect("call:")
    name = reader.bare_text()
    if not name:
        raise _BadCall("no tool name after call:")
    if not reader.text.startswith("{", reader.pos):
        raise _BadCall(f"expected {{ after the tool name {name!r}")
    arguments = reader.value(1)
    if reader.text[reader.pos :].strip():
        raise _BadCall(f"unexpected text after the arguments at character {reader.pos}")
    return [_tool_call({"name": name, "arguments": arguments})]


def parse_gemma4(text: str) -> ParsedTurn:
    """Parse the Gemma 4 format: `<|tool_call>call:NAME{key:value,...}<tool_call|>`.

    Values are typed by how they are written (see `_GemmaReader`): strings between `<|"|>`
    marks, objects with bare or quoted keys, arrays, `true` / `false` / `null`, numbers. Any
    number of blocks may appear; each that cannot be read, or that the turn ended inside,
    gives one error and the others are still read. `content` is the text outside the blocks,
    stripped (a thought channel, if any, stays in it).

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.

    Returns:
        The content, the tool calls, and one error message per block that could not be read.

    Example:
        >>> parse_gemma4('<|tool_call>call:add{a:1,text:<|"|>hi<|"|>}<tool_call|>').tool_calls
        [ToolCall(name='add', arguments={'a': 1, 'text': 'hi'})]

    """
    return _read_blocks(text, _GEMMA_BLOCK, "<tool_call|>", _gemma4_call, _GEMMA_HINT)


_LFM2_HINT = (
    "Write tool calls as <|tool_call_start|>[<tool name>(<key>=<value>, ...), ...]"
    "<|tool_call_end|>, with Python literals as values."
)
_LFM2_BLOCK = re.compile(r"<\|tool_call_start\|>(.*?)(<\|tool_call_end\|>|\Z)", re.DOTALL)
# LFM2 templates write nested objects as JSON, so JSON's words are literals too.
_LFM2_NAMES = {"true": True, "false": False, "null": None}


def _escape_raw_newlines(code: str) -> str:
    """`code` with each line break inside a quoted string written as an escape.

    Some LFM2 templates write string values between quotes as they are, line breaks included,
    which Python's grammar refuses inside a one-line string literal.
    """
    out: list[str] = []
    quote = ""
    escaped = False
    for char in code:
        if not quote:
            quote = char if char in "'\"" else ""
        elif escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == quote:
            quote = ""
        elif char in "\r\n":
            char = "\\n" if char == "\n" else "\\r"
        out.append(char)
    return "".join(out)


def _python_expression(code: str) -> ast.expr:
    """Parse `code` (a block as `_escape_raw_newlines` wrote it) as one Python expression.

    Nothing of it runs: only the syntax tree is built.
    """
    try:
        with warnings.catch_warnings():  # an invalid escape such as '\d' only warns
            warnings.simplefilter("ignore")
            return ast.parse(code, mode="eval").body
    except SyntaxError as exc:
        if "integer string conversion" in exc.msg:  # said as `_json_int` says it
            limit = sys.get_int_max_str_digits()
            raise _BadCall(f"an integer has more than {limit} digits") from None
        where = f" at line {exc.lineno} column {exc.offset}" if exc.offset else ""
        raise _BadCall(f"{exc.msg}{where}") from None
    except ValueError as exc:  # a NUL byte or a lone surrogate in the text
        raise _BadCall(str(exc)) from None
    except (RecursionError, MemoryError):  # the parser's own bound on nesting
        raise _BadCall("the call nests too deep") from None


def _literal(node: ast.expr, code: str, depth: int) -> Any:
    """The JSON value a literal expression of `code` stands for; anything else is `_BadCall`."""
    if depth > MAX_JSON_DEPTH:
        raise _BadCall(_TOO_DEEP)
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | None):
        return node.value
    if isinstance(node, ast.Name) and node.id in _LFM2_NAMES:
        return _LFM2_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = node.operand.value if isinstance(node.operand, ast.Constant) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item, code, depth + 1) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [None if k is None else _literal(k, code, depth + 1) for k in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise _BadCall("the keys of an object must be strings")
        return {k: _literal(v, code, depth + 1) for k, v in zip(keys, node.values, strict=True)}
    raise _BadCall(f"{_source(code, node)} is not a literal value")


def _source(code: str, node: ast.expr) -> str:
    """A short quote of the text of `node`, read off its offsets (no walk of a deep tree)."""
    return _quoted(ast.get_source_segment(code, node) or "")


def _lfm2_call(node: ast.expr, code: str) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise _BadCall(f"{_source(code, node)} is not a call <tool name>(<key>=<value>, ...)")
    name = node.func.id
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        raise _BadCall(f"the arguments of {name!r} must each be given as <key>=<value>")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg in arguments:
            raise _BadCall(f"the argument {keyword.arg!r} of {name!r} is given twice")
        arguments[str(keyword.arg)] = _literal(keyword.value, code, 2)
    return _tool_call({"name": name, "arguments": arguments})


def _lfm2_calls(body: str) -> _CallsOrErrors:
    code = _escape_raw_newlines(body.strip())
    expression = _python_expression(code)
    nodes = expression.elts if isinstance(expression, ast.List) else [expression]
    found: _CallsOrErrors = []
    for node in nodes:
        try:
            found.append(_lfm2_call(node, code))
        except _BadCall as exc:
            found.append(exc)
    return found


def parse_lfm2(text: str) -> ParsedTurn:
    r"""Parse the LFM2 format: `<|tool_call_start|>[NAME(key=value, ...), ...]<|tool_call_end|>`.

    The block holds a Python list of calls (one bare call is read too), parsed with `ast` and
    never run: values must be literals (strings, numbers, `True` / `False` / `None`, lists,
    tuples, dicts with string keys, and JSON's `true` / `false` / `null`, which LFM2 templates
    write inside objects); line breaks inside quotes are read as `\n`. A call that is not
    `NAME(key=value, ...)` or holds another expression gives one error and the other calls of
    the block are still read; a block that is not Python, or that the turn ended inside, gives
    one error. `content` is the text outside the blocks, stripped.

    Args:
        text: One assistant turn as decoded text, without the end-of-turn token.

    Returns:
        The content, the tool calls, and one error message per call that could not be read.

    Example:
        >>> turn = parse_lfm2("On it.<|tool_call_start|>[add(a=1, b=-2)]<|tool_call_end|>")
        >>> turn.content, turn.tool_calls
        ('On it.', [ToolCall(name='add', arguments={'a': 1, 'b': -2})])

    """
    return _read_blocks(text, _LFM2_BLOCK, "<|tool_call_end|>", _lfm2_calls, _LFM2_HINT)


_MARKED_FORMATS = {
    "<|tool_call>call:": "gemma4",
    "<|tool_call_start|>": "lfm2",
    _DEEPSEEK_CALL: "deepseek_v3",
}


PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "deepseek_v3": parse_deepseek_v3,
    "gemma4": parse_gemma4,
    "lfm2": parse_lfm2,
}


def get_parser(name: str) -> Parser:
    """Return the parser registered under `name` in `PARSERS`.

    Raises:
        ValueError: If no parser has that name; the message lists the valid names.

    """
    try:
        return PARSERS[name]
    except KeyError:
        valid = ", ".join(repr(known) for known in sorted(PARSERS))
        raise ValueError(f"unknown tool_call_parser {name!r}; valid names: {valid}") from None


def detect_parser(chat_template: str) -> str:
    """Return the name of the parser that reads the tool calls a chat template asks for.

    Conservative: `"hermes"` when the template source contains `<tool_call>` (and no XML-style
    `<function=` markup inside it); `"llama3_json"` when it contains `<|python_tag|>`, or a
    `"parameters"` key together with `ipython` or `<|eom_id|>`. Anything else raises.

    Args:
        chat_template: The Jinja source of the chat template.

    Raises:
        TypeError: If `chat_template` is not a string (e.g. a dict of named templates).
        ValueError: If the format cannot be told, or both formats seem present; the message says
            to pass `tool_call_parser=...` explicitly.

    """
    if not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be the template source, got {type(chat_template)}")
    for marker, name in _MARKED_FORMATS.items():
        if marker in chat_template:
            return name
    hermes = "<tool_call>" in chat_template and "<function=" not in chat_template
    llama3 = _PYTHON_TAG in chat_template or (
        _PARAMETERS_KEY.search(chat_template) is not None
        and ("ipython" in chat_template or "<|eom_id|>" in chat_template)
    )
    if hermes != llama3:
        return "hermes" if hermes else "llama3_json"
    found = "both the Hermes and the Llama 3 tool format" if hermes else "no tool format it knows"
    valid = ", ".join(repr(known) for known in sorted(PARSERS))
    raise ValueError(
        f"cannot tell how this chat template writes tool calls (found {found}). If the model "
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
