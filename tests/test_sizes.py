"""Every library module stays a room one reads whole: short files of short functions.

A flat room regrows one feature at a time, each addition small; the budget makes the addition
that passes it fail here, so it is split when it is written, not months later. The trainer is
glue between transformers' hooks and the round, and keeps a tighter budget: set-up that belongs
to some data lives beside that data (models, wiring, loss step, reporting).

A function's length is its body's, its docstring left out: a contract stated in full is not
what makes a function hard to read.

A room is also read by its signatures: a parameter named `args` or `config` holding the run's
config says which config it reads (`GRPOConfig`, a field group, a model's `PreTrainedConfig`, a
Protocol of the fields it reads), never `Any`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["tools", "environments", "rollout", "agentgrpo"]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
TRAINER = ROOT / "agentgrpo" / "training" / "trainer.py"
MAX_TRAINER_LINES = 490
MAX_TRAINER_FUNCTION_LINES = 30


def body_lengths(path: Path) -> dict[str, int]:
    """Each function's (and method's) body length in lines, docstring left out, by name."""
    lengths = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if len(body) > 1 and _is_docstring(body[0]):
                body = body[1:]
            assert node.end_lineno is not None
            lengths[f"{node.name}:{node.lineno}"] = node.end_lineno - body[0].lineno + 1
    return lengths


def _is_docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


def library_modules(layer: str) -> list[Path]:
    return sorted((ROOT / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_no_library_module_is_long(layer):
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in library_modules(layer)
    }
    assert lengths, layer
    long = {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules longer than {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.parametrize("layer", LAYERS)
def test_no_library_function_is_long(layer):
    long = {
        f"{path.relative_to(ROOT)}:{name}": n
        for path in library_modules(layer)
        for name, n in body_lengths(path).items()
        if n > MAX_FUNCTION_LINES
    }
    assert not long, f"function bodies longer than {MAX_FUNCTION_LINES} lines: {long}"


def test_the_trainer_module_stays_shorter():
    lengths = body_lengths(TRAINER)
    assert any(name.startswith("__init__:") for name in lengths)  # the walk sees the methods
    lines = len(TRAINER.read_text().splitlines())
    assert lines <= MAX_TRAINER_LINES, f"agentgrpo/training/trainer.py has {lines} lines"
    long = {name: n for name, n in lengths.items() if n > MAX_TRAINER_FUNCTION_LINES}
    assert not long, f"trainer functions longer than {MAX_TRAINER_FUNCTION_LINES} lines: {long}"


def test_a_body_is_measured_without_its_docstring(tmp_path):
    module = tmp_path / "example.py"
    module.write_text('def f():\n    """Doc.\n\n    More.\n    """\n    a = 1\n    return a\n')
    assert body_lengths(module) == {"f:1": 2}


# --------------------------------------------------------------------------- config parameters

CONFIG_PARAMETERS = {"args", "config"}


def is_any(annotation: ast.expr | None) -> bool:
    """Whether an annotation is `Any` (`typing.Any`, `"Any"`, or a union with Any in it)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return is_any(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return is_any(annotation.left) or is_any(annotation.right)
    return (isinstance(annotation, ast.Name) and annotation.id == "Any") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "Any"
    )


def config_parameters_typed_any(path: Path) -> list[str]:
    """`line function(name)` for each `args` or `config` parameter annotated `Any` in `path`.

    Positional and keyword parameters only: `*args: Any` and `**kwargs: Any` pass values on.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            for parameter in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                if parameter.arg in CONFIG_PARAMETERS and is_any(parameter.annotation):
                    found.append(f"{node.lineno} {node.name}({parameter.arg})")
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_no_config_parameter_is_typed_any(layer):
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in library_modules(layer)
        if (found := config_parameters_typed_any(path))
    }
    assert not offenders, (
        "`args`/`config` parameters typed Any (annotate the config they read: GRPOConfig, a "
        f"field group, PreTrainedConfig, a Protocol): {offenders}"
    )


def test_only_config_parameters_typed_any_are_found(tmp_path):
    module = tmp_path / "example.py"
    module.write_text(
        "from typing import Any\n"
        "import typing\n"
        "def a(args: Any, *rest: Any, **kwargs: Any): ...\n"
        "def b(*args: Any, config: typing.Any | None = None): ...\n"
        "async def c(model: Any, args: 'Any', /): ...\n"
        "def d(args: GRPOConfig, config: PreTrainedConfig, settings: Any): ...\n"
    )
    assert config_parameters_typed_any(module) == ["3 a(args)", "4 b(config)", "5 c(args)"]
