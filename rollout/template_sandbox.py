"""Rendering chat templates bounded in time, in output and in the size of what they build.

A chat template comes from a model folder (`tokenizer_config.json`, `chat_template.jinja`) or
from the user: it is code the project did not write. jinja2's sandbox keeps it away from
Python's internals, not from working or allocating without end: `('x' * 2000000000)|length`
builds two gigabytes, and two nested `range(100000)` loops run for hours. Every render and
compile here runs under a `RenderLimits`, and a template past a bound stops with
`TemplateRenderError`, which names the template, the bound, the template's line and what to do:

- time: `timeout_s`, checked at every loop pass, call (macros included), filter, operator and
  piece of output;
- output: the rendered text is at most `max_chars` characters;
- values: a string, list or tuple the template builds (with `*`, `+`, `~`, `%`, a filter, a
  method, a macro) is at most `max_chars` long, and a number at most `MAX_INT_BITS` bits. Where
  the size follows from the arguments (repeating, concatenating, padding, joining, replacing,
  formatting, a power) the value is refused before it is built; otherwise right after;
- work: the characters and items built, plus one per loop pass, add up to at most `max_work`
  in one render, so memory stays bounded even where each value is small.

Real templates render a conversation in milliseconds and build a few times its size, far from
these bounds; what they render is unchanged (the chat-template tests render every template TRL
ships). `BoundedSandbox` does the checking: it intercepts the operators, calls and filters, and
rewrites each `for` loop and `~` of the parsed template so that they pass through a check;
`rollout.template_sizes` tells the size of a value from the arguments that build it.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum, pass_context
from jinja2.visitor import NodeTransformer

from rollout.template_sizes import FILTER_SIZES, METHOD_SIZES, estimate, format_size, text_size

MAX_INT_BITS = 1 << 16
"""The largest number a template may build, in bits (Python prints at most 4300 digits)."""

_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
_LOOP = "agentgrpo_bounded_loop"
_CONCAT = "agentgrpo_bounded_concat"
_FIX = (
    "A chat template renders a conversation in milliseconds and a few times its size; this one "
    "loops, recurses or builds text without end. Fix the template, or pass another one "
    "(chat_template= / --chat-template; 'chatml_tools' for ChatML models)."
)


@dataclass(frozen=True)
class RenderLimits:
    """The bounds every render (and compile) of a chat template runs under.

    Attributes:
        timeout_s: Wall-clock seconds one render may take.
        max_chars: The most characters a render outputs, and the most characters or items any
            one string, list or tuple the template builds may hold.
        max_work: The most characters and items a render may build in all, plus one per loop
            pass (what it holds in memory at once is at most this).

    """

    timeout_s: float = 10.0
    max_chars: int = 1 << 24
    max_work: int = 1 << 26


class TemplateRenderError(RuntimeError):
    """A chat template went past a bound of its `RenderLimits`.

    Not a `jinja2.TemplateError`: the template, not the model's output, is at fault, so a run
    stops on it (loud) instead of recording an episode error.
    """


class _Budget:
    """What one render has spent: its deadline, the work and output so far."""

    def __init__(self, limits: RenderLimits, source: str):
        self.limits = limits
        self.source = source
        self.deadline = time.monotonic() + limits.timeout_s
        self.work = 0
        self.output = 0

    def tick(self) -> None:
        """Raise once the render is past its deadline."""
        if time.monotonic() > self.deadline:
            raise self.error(f"ran past the render time limit of {self.limits.timeout_s:g} s")

    def expect(self, size: int, what: str) -> None:
        """Refuse, before it is built, a value of `size` characters or items made by `what`."""
        self.tick()
        if size > self.limits.max_chars:
            raise self.error(
                f"builds a value of {size:,} characters or items with {what}, over the bound "
                f"of {self.limits.max_chars:,}"
            )

    def built(self, value: Any, what: str) -> Any:
        """`value`, made by `what`, once its size is within the bounds and counted as work."""
        if isinstance(value, _SIZED):
            size = len(value)
            if size > self.limits.max_chars:
                self.expect(size, what)  # raises, naming the bound
            self.spend(size)
        elif type(value) is int and value.bit_length() > MAX_INT_BITS:
            raise self.error(
                f"builds a number of {value.bit_length():,} bits with {what}, over the bound of "
                f"{MAX_INT_BITS:,}"
            )
        return value

    def spend(self, units: int) -> None:
        """Count `units` of work (characters or items built, loop passes)."""
        self.work += units
        if self.work > self.limits.max_work:
            raise self.error(
                f"built more than {self.limits.max_work:,} characters, items and loop passes "
                f"in one render"
            )

    def emit(self, piece: str) -> None:
        """Count a piece of the rendered text against `max_chars`."""
        self.tick()
        self.output += len(piece)
        if self.output > self.limits.max_chars:
            raise self.error(f"rendered more than {self.limits.max_chars:,} characters")

    def error(self, what: str) -> TemplateRenderError:
        return TemplateRenderError(f"{self.source} {what}{_template_line()}. {_FIX}")


_ACTIVE: ContextVar[_Budget | None] = ContextVar("agentgrpo_template_budget", default=None)


def _budget() -> _Budget:
    """The running render's budget (outside `bounded`, a fresh one: sizes are still bounded)."""
    return _ACTIVE.get() or _Budget(RenderLimits(), "The chat template")


@contextmanager
def bounded(limits: RenderLimits, source: str) -> Iterator[_Budget]:
    """Run a compile or render of a `BoundedSandbox` template under `limits`.

    Args:
        limits: The bounds.
        source: How errors name the template, as the start of a sentence ("The chat template
            of 'path/to/model'").

    """
    budget = _Budget(limits, source)
    token = _ACTIVE.set(budget)
    try:
        yield budget
    finally:
        _ACTIVE.reset(token)


def render_bounded(
    template: jinja2.Template, variables: Mapping[str, Any], limits: RenderLimits, source: str
) -> str:
    """`template` (compiled by a `BoundedSandbox`) rendered with `variables` under `limits`.

    Raises:
        TemplateRenderError: The render went past a bound (`source` names the template), or
            recursed without end.
        jinja2.TemplateError: The template itself failed (`raise_exception`, a syntax error).

    """
    with bounded(limits, source) as budget:
        pieces = []
        try:
            for piece in template.generate(**variables):
                budget.emit(piece)
                pieces.append(piece)
        except RecursionError:  # a macro or recursive loop that calls itself without end
            raise budget.error("recursed deeper than Python allows") from None
        return "".join(pieces)


def _template_line() -> str:
    """` (line N of the template)` for the template frame the check was called from, or ''."""
    frame = sys._getframe(1)
    while frame is not None:
        template = frame.f_globals.get("__jinja_template__")
        if template is not None:
            return f" (line {template.get_corresponding_lineno(frame.f_lineno)} of the template)"
        frame = frame.f_back  # type: ignore[assignment]
    return ""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with every render bounded as the module docstring says.

    Its templates are rendered with `render_bounded` (and compiled under `bounded`).

    Args:
        filters: Filters to add (bounded like jinja's own).
        globals: Globals to add.
        **options: `jinja2.Environment` options (`trim_blocks`, `extensions`, ...).

    """

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(
        self,
        filters: Mapping[str, Callable[..., Any]] | None = None,
        globals: Mapping[str, Any] | None = None,
        **options: Any,
    ):
        super().__init__(finalize=_finalize, **options)
        self.filters.update(filters or {})
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters[_LOOP] = _bounded_loop
        self.filters[_CONCAT] = _bounded_concat
        self.globals.update(globals or {}, lipsum=_bounded_lipsum)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The parsed template, each `for` loop's iterable and each `~` passed through a check.

        jinja2 has no hook for either: a loop iterates in the generated code, and `~` joins
        there too.
        """
        tree = _Checkpoints().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """`left operator right`, refused before it is built when it would be too large."""
        budget, what = _budget(), f"`{operator}`"
        _expect_binop(budget, operator, left, right)
        return budget.built(super().call_binop(context, operator, left, right), what)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        """A call from the template (a macro, a method, a global): timed and its result sized."""
        budget = _budget()
        budget.tick()
        name = str(getattr(__obj, "__name__", None) or getattr(__obj, "name", None) or "call")
        size = METHOD_SIZES.get(name) if isinstance(_owner(__obj), (str, bytes, int)) else None
        if size is not None:
            cap = budget.limits.max_chars
            budget.expect(estimate(size, cap, _owner(__obj), *args, **kwargs), f"`{name}()`")
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.built(result, f"`{name}()`")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """jinja2's sandboxed `str.format`, refused before it formats a value too large."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template_text = value.__self__

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            budget = _budget()
            values = (*args, *kwargs.values())
            budget.expect(format_size(budget.limits.max_chars, template_text, values), "`format()`")
            return budget.built(wrapped(*args, **kwargs), "`format()`")

        return bounded_format


class _Checkpoints(NodeTransformer):
    """Wraps each `for` loop's iterable in the loop check and turns each `~` into a checked join."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)  # in place: the loop's own nodes first
        node.iter = nodes.Filter(node.iter, _LOOP, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        parts = nodes.List(node.nodes, lineno=node.lineno)
        return nodes.Filter(parts, _CONCAT, [], [], None, None, lineno=node.lineno)


@pass_context  # never folded at compile time: it must run, and count, at render time
def _bounded_loop(context: Any, iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _budget()
    for item in iterable:
        budget.tick()
        budget.spend(1)
        yield item


@pass_context
def _bounded_concat(context: Any, parts: list[Any]) -> str:
    budget = _budget()
    texts = [_text(budget, part) for part in parts]
    budget.expect(sum(map(len, texts)), "`~`")
    return budget.built("".join(texts), "`~`")


def _finalize(value: Any) -> str:
    """Each `{{ ... }}`'s text, as jinja2 writes it (`str`), timed and counted."""
    budget = _budget()
    return budget.built(_text(budget, value), "`{{ }}`")


def _text(budget: _Budget, value: Any) -> str:
    if isinstance(value, str):
        return value
    budget.expect(text_size(budget.limits.max_chars, value), "a value written as text")
    return str(value)


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    _budget().expect(n * max * 16, "`lipsum()`")  # a word is at most about 15 characters
    return generate_lorem_ipsum(n, html, min, max)


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` timed, sized before it runs where `FILTER_SIZES` can tell, and sized after."""
    size = FILTER_SIZES.get(name)
    # A filter marked pass_context (and the like) gets that first: the value comes after it.
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    what = f"the `{name}` filter"

    @functools.wraps(func)  # keeps `jinja_pass_arg`
    def bounded_filter(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        if size is not None:
            budget.expect(estimate(size, budget.limits.max_chars, *args[skip:], **kwargs), what)
        return budget.built(func(*args, **kwargs), what)

    return bounded_filter


def _owner(method: Any) -> Any:
    return getattr(method, "__self__", None)


def _expect_binop(budget: _Budget, operator: str, left: Any, right: Any) -> None:
    """Refuse `left operator right` before it is computed, where its size is known already."""
    what, cap = f"`{operator}`", budget.limits.max_chars
    sequence = str | bytes | list | tuple
    if operator == "*" and isinstance(left, sequence) and isinstance(right, int):
        budget.expect(len(left) * right, what)
    elif operator == "*" and isinstance(right, sequence) and isinstance(left, int):
        budget.expect(len(right) * left, what)
    elif operator == "+" and isinstance(left, sequence) and isinstance(right, sequence):
        budget.expect(len(left) + len(right), what)
    elif operator == "%" and isinstance(left, str | bytes):
        values = right if isinstance(right, tuple) else (right,)
        budget.expect(format_size(cap, left, values), what)
    elif isinstance(left, int) and isinstance(right, int):
        bits = {
            "*": left.bit_length() + right.bit_length(),
            "**": right * max(left.bit_length() - 1, 0) if right > 0 else 0,
        }.get(operator, 0)
        if bits > MAX_INT_BITS:
            raise budget.error(
                f"would build a number of about {bits:,} bits with {what}, over the bound of "
                f"{MAX_INT_BITS:,}"
            )
