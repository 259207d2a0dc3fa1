"""How large a value a chat template's operation builds, told from its arguments beforehand.

`rollout.template_sandbox` refuses a value past its bound before building it where these can
tell: padding (`center`, `ljust`, `zfill`), repeating and joining, replacing, formatting (`%`,
`format`, widths and precisions included), writing a structure as text (`tojson`, `string`).
Each estimate is a lower bound, or close to one: an estimate too high would refuse a template
that renders, one too low only leaves the check to the size of the result.

Every function takes `cap` first (the bound it is compared with) and stops counting past it, so
sizing costs no more than building a value of `cap` characters would.
"""

from __future__ import annotations

import re
import string
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_CONTAINERS = (Mapping, list, tuple, set, frozenset)


def estimate(size: Callable[..., int], cap: int, *args: Any, **kwargs: Any) -> int:
    """`size(cap, *args, **kwargs)`, or 0 where the arguments are wrong (the call will say so)."""
    try:
        return size(cap, *args, **kwargs)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return 0


def text_size(cap: int, value: Any, indent: Any = None) -> int:
    """About how many characters `value` takes as text (`str`, `tojson`, a join), at least.

    Each string counts its length, each item of a list, tuple or mapping two more (punctuation)
    plus `indent` per level of nesting. A container counts two per item before its items are
    walked (breadth first), so a list holding one big value a thousand times passes `cap` after
    a few steps; the walk stops there.

    >>> text_size(100, ["ab", {"c": 1}]), text_size(100, ["x" * 60] * 1000) > 100
    (11, True)
    """
    width = _width(indent)
    total, level = _shallow_size(value, 0), deque([(value, 1)])
    if not isinstance(value, _CONTAINERS):
        level.clear()
    while level and total <= cap:
        container, depth = level.popleft()
        mapping = isinstance(container, Mapping)
        for item in [*container.keys(), *container.values()] if mapping else container:
            total += _shallow_size(item, width * depth)
            if isinstance(item, _CONTAINERS):
                level.append((item, depth + 1))
            if total > cap:
                break
    return total


def _shallow_size(value: Any, indent: int) -> int:
    """What `value` adds to `text_size` before its items are walked (two per item)."""
    if isinstance(value, str | bytes):
        return indent + len(value)
    if isinstance(value, Mapping):
        return indent + 4 * len(value)
    if isinstance(value, list | tuple | set | frozenset):
        return indent + 2 * len(value)
    if isinstance(value, int):
        return indent + value.bit_length() // 3
    return indent + 2


def _width(indent: Any) -> int:
    """The characters an `indent` argument writes per level: an int, or a string's length."""
    if isinstance(indent, str):
        return len(indent)
    return indent if isinstance(indent, int) and indent > 0 else 0


# `%`-style and `{}`-style widths and precisions: `%-10.3f`, `{:>10}`, `{0:_^{width}.3}`.
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"^(?:.?[<>=^])?[+\- ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?")


def format_size(cap: int, template_text: str | bytes, values: Iterable[Any]) -> int:
    """At least about how long formatting `values` into `template_text` (`%` or `format`) is.

    The text, each width and precision it names, and the values as text; where a width comes
    from the values (`%*d`, `{:{}}`), every integer among them (and in a mapping among them)
    counts as a width.

    >>> format_size(10**9, "%-8s|{:>20}", ()), format_size(10**9, "%*d", (10**6, 1)) > 10**6
    (39, True)
    """
    values = tuple(values)
    text = template_text.decode("latin-1") if isinstance(template_text, bytes) else template_text
    widths = [w for match in _PERCENT_SPEC.finditer(text) for w in match.groups() if w]
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(text) if spec]
    except ValueError:  # not a `{}` template; `format` would say so
        specs = []
    for spec in specs:
        match = _BRACE_SPEC.match(spec)
        widths += [w for w in match.groups() if w] if match else []
        widths += ["*"] if "{" in spec else []
    literal = sum(int(w) for w in widths if w != "*")
    from_values = _integers(values) if "*" in widths else 0
    return len(text) + literal + from_values + text_size(cap, values)


def _integers(values: tuple[Any, ...]) -> int:
    """The sum of the integers among `values` and among the values of mappings in them."""
    inner = [v for m in values if isinstance(m, Mapping) for v in m.values()]
    return sum(abs(v) for v in (*values, *inner) if isinstance(v, int))


def _length(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


def _replaced(cap: int, text: Any, old: Any, new: Any, count: Any = -1, /) -> int:
    found = text.count(old) if old else len(text) + 1
    found = found if count is None or count < 0 else min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _padded(cap: int, text: Any, width: int, /, *_: Any) -> int:
    return max(len(text), width)


def _expanded(cap: int, text: Any, /, tabsize: int = 8) -> int:
    return len(text) + text.count("\t" if isinstance(text, str) else b"\t") * tabsize


def _joined(cap: int, separator: Any, iterable: Any, /, *_: Any) -> int:
    return text_size(cap, iterable) + _length(iterable) * len(separator)


def _translated(cap: int, text: Any, table: Any, /) -> int:
    if not isinstance(table, Mapping):
        return len(text)
    return len(text) * max((text_size(cap, v) for v in table.values()), default=1)


def _indented(cap: int, /, value: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    text = str(value)
    return len(text) + (text.count("\n") + 1) * _width(width)


def _wrapped(cap: int, /, s: Any, width: int = 79, long: bool = True, wrapstring: Any = None,
             *_: Any, **__: Any) -> int:  # fmt: skip
    return len(s) * (1 + len(wrapstring or "\n"))


def _batched(cap: int, /, value: Any, linecount: int, fill_with: Any = None) -> int:
    return _length(value) + (linecount if fill_with is not None else 0)


METHOD_SIZES: dict[str, Callable[..., int]] = {
    "to_bytes": lambda cap, number, length=1, /, *_, **__: length,
    "center": _padded,
    "ljust": _padded,
    "rjust": _padded,
    "zfill": _padded,
    "expandtabs": _expanded,
    "replace": _replaced,
    "join": _joined,
    "translate": _translated,
}
"""The result size of str, bytes and int methods whose arguments decide it: (cap, self, *args)."""

FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda cap, /, value, width=80: max(len(str(value)), width),
    "indent": _indented,
    "join": lambda cap, /, value, d="", attribute=None: _joined(cap, d, value),
    "replace": lambda cap, /, s, old, new, count=None: _replaced(cap, str(s), old, new, count),
    "format": lambda cap, /, value, *args, **kwargs: format_size(
        cap, value, (*args, *kwargs.values())
    ),
    "wordwrap": _wrapped,
    "tojson": lambda cap, /, value, *_, indent=None, **__: text_size(cap, value, indent),
    "string": lambda cap, /, value: text_size(cap, value),
    "pprint": lambda cap, /, value: text_size(cap, value),
    "sum": lambda cap, /, iterable, attribute=None, start=0: text_size(cap, (iterable, start)),
    "batch": _batched,
    "slice": lambda cap, /, value, slices, fill_with=None: _length(value) + slices,
}
"""The same for jinja2's filters: (cap, the filtered value, the filter's arguments)."""
