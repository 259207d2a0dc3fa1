"""Tests for tools/: schemas from typed functions, safe calls, and the calculator."""

from __future__ import annotations

import ast
import asyncio
import importlib
import sys
import threading
from typing import Literal

import anyio
import anyio.lowlevel
import pytest

from tools import (
    Tool,
    ToolDefinitionError,
    ToolErrorKind,
    ToolResult,
    ToolResultError,
    as_tool,
    calculator,
    call_tool,
)

calculator_module = importlib.import_module(
    "tools.calculator"
)  # `tools.calculator` is the function

# --- functions used as tools -------------------------------------------------------------


def increment(step: int, note: str | None = None) -> int:
    """Add step to the counter.

    Args:
        step: Value to add; must be positive.
        note: Optional remark, ignored.
    """
    if step <= 0:
        raise ValueError("step must be positive")
    return 10 + step


def reset_counter() -> None:
    """Set the counter back to zero."""


async def fetch(url: str) -> str:
    """Fetch a page.

    Args:
        url: Address of the page.
    """
    await anyio.lowlevel.checkpoint()
    return f"<html>{url}</html>"


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def increment(self, step: int) -> int:
        """Add step to the counter.

        Args:
            step: Value to add.
        """
        self.value += step
        return self.value


def _tools(*fns) -> dict[str, Tool]:
    tools = [as_tool(fn) for fn in fns]
    return {tool.name: tool for tool in tools}


# --- as_tool: schemas ----------------------------------------------------------------------


def test_schema_of_a_typed_docstringed_function_has_types_descriptions_and_required():
    schema = as_tool(increment).schema
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "increment"
    assert function["description"] == "Add step to the counter."
    assert function["parameters"] == {
        "type": "object",
        "properties": {
            "step": {"type": "integer", "description": "Value to add; must be positive."},
            "note": {
                "type": "string",
                "nullable": True,
                "description": "Optional remark, ignored.",
            },
        },
        "required": ["step"],
    }


def test_schema_of_an_async_function_is_built_like_a_sync_one():
    tool = as_tool(fetch)
    assert tool.fn is fetch
    assert tool.schema["function"]["parameters"]["properties"] == {
        "url": {"type": "string", "description": "Address of the page."}
    }


def test_schema_of_a_bound_method_leaves_out_self():
    env = Counter()
    tool = as_tool(env.increment)
    assert tool.name == "increment"
    assert list(tool.schema["function"]["parameters"]["properties"]) == ["step"]
    assert tool.schema["function"]["parameters"]["required"] == ["step"]


def test_name_overrides_the_schema_name():
    tool = as_tool(increment, name="add_to_counter")
    assert tool.name == "add_to_counter"
    assert tool.schema["function"]["name"] == "add_to_counter"


def test_tool_refuses_a_schema_whose_name_disagrees():
    schema = as_tool(increment).schema
    with pytest.raises(ToolDefinitionError, match="must equal the tool's name"):
        Tool(name="other", schema=schema, fn=increment)


# --- as_tool: definition errors ---------------------------------------------------------------


def no_docstring(x: int) -> int:
    return x


def missing_hint(x) -> int:
    """Do it.

    Args:
        x: A value.
    """
    return x


def missing_description(x: int, y: int) -> int:
    """Do it.

    Args:
        x: A value.
    """
    return x + y


def typed_description(x: int) -> int:
    """Do it.

    Args:
        x (int): A value.
    """
    return x


def no_args_section(x: int) -> int:
    """Do it with x."""
    return x


def no_summary(x: int) -> int:
    """Args:
    x: A value.
    """
    return x


def takes_kwargs(**options: int) -> int:
    """Do it.

    Args:
        options: Values.
    """
    return len(options)


def positional_only(x: int, /) -> int:
    """Do it.

    Args:
        x: A value.
    """
    return x


class Opaque:
    pass


def class_hint(x: Opaque) -> int:
    """Do it.

    Args:
        x: A value.
    """
    return 0


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (no_docstring, r"as_tool\(no_docstring\): it has no docstring; add a Google-style"),
        (missing_hint, r"argument 'x' has no type hint; annotate it, e\.g\. `x: int`"),
        (
            missing_description,
            r"as_tool\(missing_description\): argument 'y' is not described in the "
            r"docstring's `Args:` section; add a line `y: <what it means>`",
        ),
        (typed_description, r"Write `x: description`; the `x \(type\): \.\.\.` form is not read"),
        (no_args_section, r"has no `Args:` section; add one .* for each of: x\."),
        (no_summary, r"has no summary before `Args:`"),
        (takes_kwargs, r"argument 'options' is variadic .*list each one explicitly"),
        (positional_only, r"argument 'x' is positional-only"),
        (class_hint, r"argument 'x' has type hint .*Opaque.*which has no JSON type"),
        (Counter.increment, r"as_tool\(Counter\.increment\): this is an unbound method; .*"),
    ],
)
def test_as_tool_says_what_to_fix(fn, message):
    with pytest.raises(ToolDefinitionError, match=message):
        as_tool(fn)


def test_definition_error_is_a_type_error():
    assert issubclass(ToolDefinitionError, TypeError)


def test_as_tool_refuses_a_name_chat_templates_cannot_carry():
    with pytest.raises(ToolDefinitionError, match="tool name 'add one' is not usable"):
        as_tool(increment, name="add one")


def test_as_tool_wraps_transformers_errors_and_keeps_them_as_cause():
    def pair(x: tuple[int]) -> int:
        """Do it.

        Args:
            x: A pair.
        """
        return 0

    with pytest.raises(ToolDefinitionError, match="transformers could not build") as info:
        as_tool(pair)
    assert info.value.__cause__ is not None


# --- call_tool: success and serialisation ---------------------------------------------------


@pytest.mark.anyio
async def test_a_sync_tool_returns_its_value_as_text():
    result = await call_tool(_tools(increment), "increment", {"step": 3}, timeout_s=2.0)
    assert result == ToolResult("increment", "13", None, result.seconds)
    assert 0 <= result.seconds < 60  # a duration in seconds (wide: a loaded machine is slow)


@pytest.mark.anyio
async def test_an_async_tool_is_awaited():
    result = await call_tool(_tools(fetch), "fetch", {"url": "a.b"}, timeout_s=None)
    assert (result.content, result.error) == ("<html>a.b</html>", None)


@pytest.mark.anyio
async def test_a_bound_method_tool_changes_its_instance():
    env = Counter()
    tools = {"increment": as_tool(env.increment)}
    await call_tool(tools, "increment", {"step": 2}, timeout_s=1.0)
    result = await call_tool(tools, "increment", {"step": 5}, timeout_s=1.0)
    assert (result.content, env.value) == ("7", 7)


def _returning(value):
    def give() -> object:
        """Return a fixed value."""
        return value

    return as_tool(give)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "content"),
    [
        ("plain text", "plain text"),
        (None, ""),
        ({"a": [1, 2], "b": "é"}, '{"a": [1, 2], "b": "é"}'),
        ([1, "x", None], '[1, "x", null]'),
        ((1, 2), "[1, 2]"),
        (3.5, "3.5"),
        (True, "True"),
    ],
)
async def test_results_are_serialised_to_text(value, content):
    result = await call_tool({"give": _returning(value)}, "give", {}, timeout_s=1.0)
    assert (result.content, result.error) == (content, None)


class _Unprintable:
    def __str__(self) -> str:
        raise ValueError("no text")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({(1, 2): "pair"}, "a dict that cannot .* \\(TypeError: keys must be str"),
        (_Unprintable(), "a _Unprintable that cannot .* \\(ValueError: no text\\)"),
    ],
)
async def test_a_value_that_cannot_become_text_is_an_error_naming_the_tools_function(
    value, problem
):
    with pytest.raises(
        ToolResultError, match=f"^tool _returning.<locals>.give\\(\\) returned {problem}"
    ):
        await call_tool({"give": _returning(value)}, "give", {}, timeout_s=1.0)


# --- call_tool: failures the model caused are data --------------------------------------------


@pytest.mark.anyio
async def test_an_unknown_tool_suggests_the_nearest_name_and_lists_the_tools():
    tools = _tools(increment, reset_counter)
    result = await call_tool(tools, "incrememt", {"step": 1}, timeout_s=1.0)
    assert result.error is ToolErrorKind.UNKNOWN_TOOL
    assert result.content == (
        "Error: unknown tool 'incrememt'. Did you mean 'increment'? "
        "Available tools: increment, reset_counter."
    )


@pytest.mark.anyio
async def test_an_unknown_tool_far_from_any_name_only_lists_the_tools():
    result = await call_tool(_tools(increment), "browse", {}, timeout_s=1.0)
    assert result.content == "Error: unknown tool 'browse'. Available tools: increment."


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("arguments", "content"),
    [
        ({}, "Error: increment() is missing required argument 'step' (integer)."),
        (
            {"step": 1, "stp": 2},
            "Error: increment() got unexpected argument 'stp'. Did you mean 'step'?",
        ),
        ({"step": 1, "colour": 2}, "Error: increment() got unexpected argument 'colour'."),
        (
            {"step": "3"},
            "Error: increment() argument 'step' must be an integer, got \"3\" (string).",
        ),
        (
            {"step": True},
            "Error: increment() argument 'step' must be an integer, got true (boolean).",
        ),
        ({"step": 2.5}, "Error: increment() argument 'step' must be an integer, got 2.5 (number)."),
        (
            {"step": 1, "note": 4},
            "Error: increment() argument 'note' must be a string or null, got 4 (integer).",
        ),
        ([1], "Error: increment() arguments must be a JSON object, got [1] (array)."),
    ],
)
async def test_bad_arguments_are_reported_to_the_model(arguments, content):
    result = await call_tool(_tools(increment), "increment", arguments, timeout_s=1.0)
    assert (result.content, result.error) == (content, ToolErrorKind.BAD_ARGUMENTS)


@pytest.mark.anyio
async def test_every_bad_argument_is_reported_at_once():
    result = await call_tool(_tools(increment), "increment", {"stp": 1}, timeout_s=1.0)
    assert result.content.splitlines() == [
        "Error: increment() is missing required argument 'step' (integer).",
        "Error: increment() got unexpected argument 'stp'. Did you mean 'step'?",
    ]


def typed(
    count: int,
    ratio: float,
    flag: bool,
    tags: list[str],
    weights: dict[str, float],
    pair: tuple[int, str],
    mode: Literal["fast", "slow"],
    either: int | str,
) -> dict:
    """Echo the arguments.

    Args:
        count: An integer.
        ratio: A number.
        flag: A boolean.
        tags: Strings.
        weights: Numbers by name.
        pair: An integer and a string.
        mode: A speed.
        either: An integer or a string.
    """
    return {"count": count, "ratio": ratio, "pair_is_tuple": isinstance(pair, tuple)}


GOOD = {
    "count": 2.0,
    "ratio": 1,
    "flag": False,
    "tags": ["a"],
    "weights": {"a": 0.5},
    "pair": [1, "x"],
    "mode": "fast",
    "either": "s",
}


@pytest.mark.anyio
async def test_valid_json_values_pass_and_integral_floats_become_ints():
    result = await call_tool(_tools(typed), "typed", GOOD, timeout_s=1.0)
    assert result.error is None
    assert result.content == '{"count": 2, "ratio": 1, "pair_is_tuple": true}'


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ratio": "1"}, "argument 'ratio' must be a number, got \"1\" (string)"),
        ({"flag": 0}, "argument 'flag' must be a boolean, got 0 (integer)"),
        ({"tags": ["a", 1]}, "argument 'tags'[1] must be a string, got 1 (integer)"),
        ({"tags": "a"}, "argument 'tags' must be an array of string, got \"a\" (string)"),
        ({"weights": {"a": "x"}}, "argument 'weights'['a'] must be a number, got \"x\" (string)"),
        ({"pair": [1]}, "argument 'pair' must have exactly 2 items, got 1"),
        ({"pair": [1, 2]}, "argument 'pair'[1] must be a string, got 2 (integer)"),
        (
            {"mode": "medium"},
            'argument \'mode\' must be one of "fast", "slow", got "medium" (string)',
        ),
        ({"either": 1.5}, "argument 'either' must be an integer or a string, got 1.5 (number)"),
    ],
)
async def test_each_json_type_is_checked(change, message):
    result = await call_tool(_tools(typed), "typed", GOOD | change, timeout_s=1.0)
    assert result.error is ToolErrorKind.BAD_ARGUMENTS
    assert result.content == f"Error: typed() {message}."


@pytest.mark.anyio
async def test_types_the_checker_does_not_know_are_accepted():
    schema = {
        "type": "function",
        "function": {
            "name": "look",
            "description": "Look at an image.",
            "parameters": {"type": "object", "properties": {"image": {"type": "image"}}},
        },
    }
    tool = Tool(name="look", schema=schema, fn=lambda image: type(image).__name__)
    result = await call_tool({"look": tool}, "look", {"image": [[0]]}, timeout_s=1.0)
    assert (result.content, result.error) == ("list", None)


@pytest.mark.anyio
async def test_an_exception_in_the_tool_becomes_an_error_message():
    result = await call_tool(_tools(increment), "increment", {"step": -1}, timeout_s=1.0)
    assert result.error is ToolErrorKind.EXCEPTION
    assert result.content == "Error: increment() raised ValueError: step must be positive"


class _BrokenMessage(Exception):
    def __str__(self) -> str:
        raise AttributeError("no message")


@pytest.mark.anyio
async def test_an_exception_whose_message_fails_names_only_its_type():
    def fail() -> None:
        """Always fail."""
        raise _BrokenMessage

    result = await call_tool(_tools(fail), "fail", {}, timeout_s=1.0)
    assert (result.content, result.error) == ("Error: fail() raised _BrokenMessage", "exception")


@pytest.mark.anyio
async def test_an_integer_too_long_to_write_out_is_said_so_to_the_model():
    # The model's arguments make it (Counter's increment with a 4,300-digit step): data.
    result = await call_tool({"give": _returning(10**5000)}, "give", {}, timeout_s=1.0)
    assert (result.content, result.error) == (
        "an integer of about 5001 digits, too long to write out",
        None,
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "content"),
    [
        ({"product": 10**5000}, '{"product": "an integer of about 5001 digits, %s"}'),
        ([1, (2, 10**5000)], '[1, [2, "an integer of about 5001 digits, %s"]]'),
        ({10**5000: 1}, '{"an integer of about 5001 digits, %s": 1}'),
    ],
)
async def test_an_integer_too_long_to_write_out_inside_a_dict_or_list_is_said_so_too(
    value, content
):
    result = await call_tool({"give": _returning(value)}, "give", {}, timeout_s=1.0)
    assert (result.content, result.error) == (content % "too long to write out", None)


@pytest.mark.anyio
async def test_a_result_that_contains_itself_is_still_an_error_naming_the_tools_function():
    looped: list = [10**5000]
    looped.append(looped)
    with pytest.raises(ToolResultError, match="Circular reference"):
        await call_tool({"give": _returning(looped)}, "give", {}, timeout_s=1.0)


@pytest.mark.anyio
async def test_an_exception_without_a_message_names_only_its_type():
    async def fail() -> None:
        """Always fail."""
        raise RuntimeError

    result = await call_tool(_tools(fail), "fail", {}, timeout_s=1.0)
    assert (result.content, result.error) == ("Error: fail() raised RuntimeError", "exception")


@pytest.mark.anyio
async def test_a_timeout_error_raised_by_the_tool_itself_is_an_exception_not_a_timeout():
    def connect() -> None:
        """Connect somewhere."""
        raise TimeoutError("socket timed out")

    result = await call_tool(_tools(connect), "connect", {}, timeout_s=5.0)
    assert result.error is ToolErrorKind.EXCEPTION
    assert result.content == "Error: connect() raised TimeoutError: socket timed out"


# --- call_tool: timeouts and concurrency ------------------------------------------------------


def stuck_tool(released: threading.Event):
    """A sync tool that blocks its thread until `released` is set (at most 60 s)."""

    def stuck() -> str:
        """Block until the test lets go."""
        released.wait(60)
        return "let go"

    return stuck


@pytest.mark.anyio
async def test_a_hung_sync_tool_times_out_quickly():
    released = threading.Event()
    try:
        result = await call_tool(_tools(stuck_tool(released)), "stuck", {}, timeout_s=0.2)
        assert not released.is_set()  # the result came while the tool still blocked
    finally:
        released.set()
    assert result.error is ToolErrorKind.TIMEOUT
    assert result.content == "Error: stuck() timed out after 0.2 s"
    assert 0.2 <= result.seconds < 30  # from the call to the timeout, not to the tool's end


@pytest.mark.anyio
async def test_a_hung_async_tool_times_out_quickly():
    async def hang() -> None:
        """Never return."""
        await anyio.sleep_forever()

    with anyio.fail_after(30):  # "does not hang" only: the tool never returns
        result = await call_tool(_tools(hang), "hang", {}, timeout_s=0.2)
    assert (result.content, result.error) == ("Error: hang() timed out after 0.2 s", "timeout")


@pytest.mark.anyio
async def test_sync_tools_run_off_the_event_loop_thread_concurrently():
    # Each call waits for all 8 to be running: one at a time, the first would wait in vain.
    everyone_running = threading.Barrier(8, timeout=30)

    def meet() -> str:
        """Wait until 8 calls run at once; return this thread's name."""
        everyone_running.wait()
        return threading.current_thread().name

    tools = _tools(meet)
    results = []

    async def one() -> None:
        results.append(await call_tool(tools, "meet", {}, timeout_s=None))

    async with anyio.create_task_group() as group:
        for _ in range(8):
            group.start_soon(one)
    assert [result.error for result in results] == [None] * 8, results[0].content
    assert threading.current_thread().name not in {result.content for result in results}


@pytest.mark.anyio
async def test_cancellation_from_outside_propagates():
    released = threading.Event()
    try:
        with anyio.move_on_after(0.1) as scope:
            await call_tool(_tools(stuck_tool(released)), "stuck", {}, timeout_s=None)
            pytest.fail("call_tool swallowed the cancellation")
    finally:
        released.set()
    assert scope.cancelled_caught


@pytest.mark.anyio
async def test_cancellation_of_an_async_tool_is_not_turned_into_a_result():
    async def hang() -> None:
        """Never return."""
        await asyncio.sleep(10)

    task = asyncio.create_task(call_tool(_tools(hang), "hang", {}, timeout_s=None))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.anyio
async def test_an_async_tool_whose_inner_task_was_cancelled_fails_like_any_exception():
    async def lookup() -> str:
        """Look up, awaiting a request that something else cancels."""
        request = asyncio.create_task(asyncio.sleep(10))
        asyncio.get_running_loop().call_later(0.01, request.cancel)
        await request
        return "found"

    result = await call_tool(_tools(lookup), "lookup", {}, timeout_s=5.0)
    assert (result.content, result.error) == ("Error: lookup() raised CancelledError", "exception")


# --- calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-2 ** 2", "-4"),
        ("(-2) ** 2", "4"),
        ("7 / 2", "3.5"),
        ("6 / 2", "3"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** -1", "0.5"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("+5 - -5", "10"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("1e20", "1e+20"),
        ("  3 ", "3"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", r"names are not allowed \('x'\)"),
        ("__import__('os')", r"function calls are not allowed"),
        ("(1).real", r"attribute access is not allowed"),
        ("'a' * 3", r"only numbers are allowed, got 'a'"),
        ("True + 1", r"only numbers are allowed, got True"),
        ("1 < 2", r"comparisons are not allowed"),
        ("[1, 2]", r"this operation is not allowed"),
        ("1 +", r"not a valid arithmetic expression"),
        ("1 / 0", r"division by zero"),
        ("5 % 0", r"division by zero"),
        ("9 ** 9 ** 9", r"exponent 387420489 is too large"),
        ("10 ** 5000", r"result is too large \(more than 10000 bits\)"),
        ("(10 ** 3000) * (10 ** 3000)", r"result is too large"),
        ("2.5 ** 9000", r"result is too large"),
        ("(-8) ** 0.5", r"not a real number"),
        ("1" * 1001, r"longer than 1000 characters"),
        ("-" * 990 + "1", r"nested too deeply \(more than 200 levels\)"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_calculator_bounds_nesting_itself_whatever_the_recursion_limit():
    assert calculator("-" * 200 + "1") == "1"  # the bound, evaluated
    # a library in the same process may raise the interpreter's limit: the refusal must not
    # depend on running out of stack (it once passed or failed with the test order)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        with pytest.raises(ValueError, match="more than 200 levels"):
            calculator("-" * 990 + "1")
    finally:
        sys.setrecursionlimit(limit)


def test_calculator_refuses_a_huge_power_without_computing_it(monkeypatch):
    powers = []
    pow_ = calculator_module._BINARY_OPS[ast.Pow]
    monkeypatch.setitem(
        calculator_module._BINARY_OPS, ast.Pow, lambda a, b: powers.append((a, b)) or pow_(a, b)
    )
    assert calculator("2 ** 10") == "1024" and powers == [(2, 10)]
    with pytest.raises(ValueError, match="more than 10000 bits"):
        calculator("123456789 ** 9999")
    assert powers == [(2, 10)]  # refused before the power was computed


@pytest.mark.anyio
async def test_calculator_is_a_tool_whose_refusals_reach_the_model():
    tools = {"calculator": as_tool(calculator)}
    ok = await call_tool(tools, "calculator", {"expression": "2 * (3 + 4)"}, timeout_s=1.0)
    refused = await call_tool(tools, "calculator", {"expression": "x"}, timeout_s=1.0)
    assert (ok.content, ok.error) == ("14", None)
    assert refused.error is ToolErrorKind.EXCEPTION
    assert refused.content.startswith("Error: calculator() raised ValueError: names are not")
