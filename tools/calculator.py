"""A built-in tool that evaluates arithmetic safely, by walking the parsed `ast` (never `eval`).

Accepted: int and float literals, `+ - * / // % **`, unary `+`/`-`, parentheses. Everything
else (names, calls, attributes, strings, comparisons, ...) raises `ValueError` naming what was
refused, which `call_tool` turns into an error message for the model.

Limits, so that one expression cannot eat the machine: at most `MAX_EXPRESSION_CHARS`
characters, exponents of magnitude at most `MAX_EXPONENT`, integer results of at most
`MAX_RESULT_BITS` bits (checked before a power is computed), finite float results, and at
most `MAX_NESTING` operators inside one another (whatever the interpreter's recursion limit).

Output format: an int prints as an int (`"14"`); a float that is integral and exactly
representable (magnitude below 2**53) prints without `.0` (`6 / 2` gives `"3"`), because
answers are usually compared as text with the integer the task expects; any other float
prints as Python's shortest round-trip `repr` (`"3.5"`, `"0.30000000000000004"`, `"1e+300"`).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from tools.syntax import parse_expression

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 10_000
MAX_RESULT_BITS = 10_000  # about 3,000 decimal digits
MAX_NESTING = 200  # operators inside operators: far below the interpreter's recursion limit
_EXACT_FLOAT_LIMIT = 2**53  # floats below this magnitude hold integers exactly

Number = int | float

_BINARY_OPS: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
# What the error message calls each refused node; anything else is "this operation is".
_REFUSED: dict[type[ast.AST], str] = {
    ast.Name: "names are",
    ast.Call: "function calls are",
    ast.Attribute: "attribute access is",
    ast.Subscript: "indexing is",
    ast.Compare: "comparisons are",
    ast.BoolOp: "'and'/'or' are",
    ast.Lambda: "lambdas are",
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Supports + - * / // % ** (power), unary minus, parentheses, integers and decimals.

    Args:
        expression: The arithmetic expression, e.g. "(3 + 4) * 2 ** 3 / 7".

    Returns:
        The value as text: "56" for an integral result, "3.5" otherwise.

    Raises:
        ValueError: If the expression is not plain arithmetic, divides by zero, or its
            result is too large.

    Examples:
        >>> calculator("(3 + 4) * 2 ** 3 / 7")
        '8'
        >>> calculator("7 / 2")
        '3.5'

    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = parse_expression(expression.strip())
    except SyntaxError as exc:
        raise ValueError(f"not a valid arithmetic expression: {exc.msg}") from None
    try:
        return _format(_evaluate(tree.body))
    except RecursionError:  # a deeper stack than MAX_NESTING allows for, still an answer
        raise ValueError("expression is nested too deeply") from None


def _evaluate(node: ast.AST, depth: int = 0) -> Number:
    """Evaluate one node of an arithmetic expression tree, `depth` operators down."""
    if depth > MAX_NESTING:
        raise ValueError(f"expression is nested too deeply (more than {MAX_NESTING} levels)")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return _checked(node.value)
        raise ValueError(f"only numbers are allowed, got {node.value!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result is too large") from None
    refused = _REFUSED.get(type(node), "this operation is")
    raise ValueError(
        f"{refused} not allowed ({ast.unparse(node)!r}); use only numbers, "
        "+ - * / // % ** and parentheses"
    )


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse a power whose exponent or integer result would be too large to compute."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is too large (limit {MAX_EXPONENT})")
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0 or abs(base) <= 1:
        return  # float powers overflow loudly on their own; the rest stay small
    if exponent * math.log2(abs(base)) > MAX_RESULT_BITS:  # bits of the result
        raise ValueError(f"result is too large (more than {MAX_RESULT_BITS} bits)")


def _checked(value: Number | complex) -> Number:
    """Refuse complex, non-finite and oversized results."""
    if isinstance(value, complex):
        raise ValueError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is too large")
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise ValueError(f"result is too large (more than {MAX_RESULT_BITS} bits)")
    return value


def _format(value: Number) -> str:
    """Render a result; integral floats that are exact print without `.0`."""
    if isinstance(value, float) and value.is_integer() and abs(value) < _EXACT_FLOAT_LIMIT:
        return str(int(value))
    return repr(value)
