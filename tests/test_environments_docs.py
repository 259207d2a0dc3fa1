"""Every Python block in environments/README.md runs, each on its own, so the docs stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "environments" / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block, in order."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_readme_has_an_example_of_each_shape():
    code = "\n".join(code for _, code in python_blocks())
    assert len(python_blocks()) >= 5
    for shape in ("class Light", "class Inventory", "gym_environment(", "demonstrations("):
        assert shape in code


@pytest.mark.parametrize(("line", "code"), python_blocks(), ids=lambda v: f"line-{v}")
def test_python_block_runs(line, code):
    namespace = {"__name__": f"readme_line_{line}"}
    exec(compile(code, f"{README}:{line}", "exec"), namespace)
