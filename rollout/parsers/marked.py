"""Tool-call formats with markers of their own: DeepSeek V3/R1, Gemma 4 and LFM2.

Each turn is read block by block between the format's markers (`_read_blocks`); a block that
cannot be read, or that the turn ended inside, is one error, and the other blocks are still
read. LFM2 writes Python call syntax, read with `ast` as literals only, never run.
"""

from __future__ import annotations

import ast
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

from rollout.parsers.common import (
    _TOO_DEEP,
    MAX_JSON_DEPTH,
    _BadCall,
    _error,
    _json_int,
    _loads,
    _quoted,
    _tool_call,
)
from rollout.types import ParsedTurn, ToolCall
from tools.syntax import parse_expression

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

    Examples:
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

    Examples:
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
            return parse_expression(code).body
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

    Examples:
        >>> turn = parse_lfm2("On it.<|tool_call_start|>[add(a=1, b=-2)]<|tool_call_end|>")
        >>> turn.content, turn.tool_calls
        ('On it.', [ToolCall(name='add', arguments={'a': 1, 'b': -2})])

    """
    return _read_blocks(text, _LFM2_BLOCK, "<|tool_call_end|>", _lfm2_calls, _LFM2_HINT)
