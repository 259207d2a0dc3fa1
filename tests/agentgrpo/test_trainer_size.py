"""The trainer stays glue between transformers' hooks and the round: a short file of short methods.

Set-up that belongs to some data lives beside that data (models, wiring, loss_step, reporting),
so the trainer reads top to bottom. The bounds are generous enough for small edits and tight
enough that a returning 80-line `__init__` fails here.
"""

import ast
from pathlib import Path

import agentgrpo.trainer

MAX_FILE_LINES = 470
MAX_FUNCTION_LINES = 50


def _trainer_source() -> str:
    return Path(agentgrpo.trainer.__file__).read_text()


def test_the_trainer_module_stays_short():
    lines = len(_trainer_source().splitlines())
    assert lines <= MAX_FILE_LINES, f"agentgrpo/trainer.py has {lines} lines"


def test_no_trainer_function_is_long():
    tree = ast.parse(_trainer_source())
    lengths = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno
    }
    assert "__init__" in lengths  # the walk sees the class's methods
    long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines: {long}"
