"""Option values typed and checked: text from the command line or a YAML value, as a field's type.

`FieldType.of(annotation)` reads what a dataclass field allows (`int | None`, `list[float]`,
an enum, a `Literal`); `FieldType.read(value)` turns a value into that type or raises
`InvalidValue`, whose text (`takes a number, not 'abc'`) the caller prefixes with the option's
name. Text is read as the first allowed type that reads it: none, a bool, an int, a float, a
JSON list or dict (a list also as `a,b`), then text.

Examples:
    >>> FieldType.of(float | None).read("1e-5"), FieldType.of(list[float]).read("1, 0.5")
    (1e-05, [1.0, 0.5])
    >>> FieldType.of(int, limit=(lambda n: n >= 1, "a whole number >= 1")).read("0")
    Traceback (most recent call last):
    ...
    agentgrpo.cli.values.InvalidValue: takes a whole number >= 1, not '0'

"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Callable
from typing import Any

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_NONE = type(None)


class InvalidValue(Exception):
    """A value its option does not take; `str()` is 'takes WHAT, not VALUE'."""

    def __init__(self, expected: str, value: Any):
        super().__init__(f"takes {expected}, not {value!r}")


Limit = tuple[Callable[[float], bool], str]
"""A range check for a number: the test, and the valid values in words ('a number >= 0')."""


@dataclasses.dataclass(frozen=True)
class FieldType:
    """What values an option takes.

    Attributes:
        kinds: The plain types allowed (`int | None` -> {int, NoneType}); enums count as str.
        choices: The texts a str value must be one of, or None for any text.
        item: A list's element type (`list[float]` -> float), or None for any.
        none_is_text: Whether the text "none" is a value of its own rather than None.
        limit: The range a number must be in, or None.
    """

    kinds: frozenset[type]
    choices: tuple[str, ...] | None = None
    item: type | None = None
    none_is_text: bool = False
    limit: Limit | None = None

    @classmethod
    def of(cls, annotation: Any, choices: typing.Iterable[str] | None = None, **more: Any):
        """The `FieldType` an annotation allows; an enum's values become its `choices`."""
        union = (
            isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
        )
        kinds, item = set(), None
        for member in typing.get_args(annotation) if union else (annotation,):
            origin = typing.get_origin(member) or member
            if origin is typing.Literal:
                kinds |= {type(value) for value in typing.get_args(member)}
            elif isinstance(origin, type) and issubclass(origin, enum.Enum):
                kinds.add(str)
                choices = choices or [option.value for option in origin]
            elif origin is list:
                kinds.add(list)
                item = (typing.get_args(member) or (None,))[0]
            elif isinstance(origin, type):
                kinds.add(str if issubclass(origin, str) else origin)
            else:
                kinds.add(str)
        return cls(frozenset(kinds), tuple(choices) if choices else None, item, **more)

    def read(self, value: Any) -> Any:
        """`value` (text, or a YAML/JSON value) as this type, inside its choices and limit.

        NaN and infinity are never values: a rate or a weight of either trains to NaN.
        """
        typed = self._from_text(value) if isinstance(value, str) else self._typed(value)
        if isinstance(typed, str) and self.choices and typed not in self.choices:
            raise InvalidValue(self.expected(), value)
        numbers = typed if isinstance(typed, list) else [typed]
        if any(isinstance(n, float) and not math.isfinite(n) for n in numbers):
            raise InvalidValue("a finite number (1e400 reads as inf)", value)
        if self.limit is not None and _is_number(typed) and not self.limit[0](typed):
            raise InvalidValue(self.limit[1], value)
        return typed

    def expected(self) -> str:
        """What the option takes, in words: 'a whole number or none'."""
        words = {
            bool: "true or false",
            int: "a whole number",
            float: "a number",
            list: "a list (JSON, or a,b)",
            dict: "a JSON object",
            str: _one_of(self.choices) if self.choices else "text",
            _NONE: "none",
        }
        if int in self.kinds:
            words.pop(float)
        parts = [text for kind, text in words.items() if kind in self.kinds]
        parts += [f"a {kind.__name__} (set in Python)" for kind in self.kinds - words.keys()]
        return " or ".join(parts)

    def _from_text(self, text: str) -> Any:
        lowered = text.strip().lower()
        if _NONE in self.kinds and lowered in ("none", "null") and not self.none_is_text:
            return None
        if bool in self.kinds and lowered in _TRUE + _FALSE:
            return lowered in _TRUE
        for number in (int, float):
            if number in self.kinds:
                with contextlib.suppress(ValueError):
                    return number(text)
        if self.kinds & {list, dict}:
            with contextlib.suppress(json.JSONDecodeError):
                parsed = json.loads(text)
                if isinstance(parsed, list | dict):
                    return self._typed(parsed)
            if list in self.kinds:
                parts = [part.strip() for part in text.split(",") if part.strip()]
                return [self._item(_number_or_text(part, self.item)) for part in parts]
        if str in self.kinds:
            return text
        raise InvalidValue(self.expected(), text)

    def _typed(self, value: Any) -> Any:
        """A YAML or JSON value checked to be of one of the kinds (an int may be a float)."""
        if isinstance(value, list) and list in self.kinds:
            return [self._item(item) for item in value]
        if isinstance(value, bool) or value is None:
            allowed = type(value) in self.kinds
        elif isinstance(value, int) and int not in self.kinds and float in self.kinds:
            return float(value)
        else:
            allowed = isinstance(value, tuple(self.kinds - {bool}))
        if not allowed:
            raise InvalidValue(self.expected(), value)
        return value

    def _item(self, item: Any) -> Any:
        """One element of a list, checked against `self.item`."""
        if self.item is float:
            if not _is_number(item):
                raise InvalidValue("a list of numbers", item)
            return float(item)
        if self.item is not None and not isinstance(item, str):
            raise InvalidValue("a list of texts", item)
        if isinstance(self.item, type) and issubclass(self.item, enum.Enum):
            values = [option.value for option in self.item]
            if item not in values:
                raise InvalidValue(f"a list of {', '.join(values)}", item)
        return item


def _number_or_text(text: str, item: type | None) -> Any:
    """One `a,b` list element: a number where the list holds numbers (so it is checked as one)."""
    if item is float:
        with contextlib.suppress(ValueError):
            return float(text)
    return text


def _one_of(choices: tuple[str, ...]) -> str:
    return choices[0] if len(choices) == 1 else "one of " + ", ".join(choices)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
