"""mkdocs hooks (mkdocs.yml `hooks:`): pages of the site that include files of the repository.

docs/benchmarks.md is one line, `--8<-- "bench/README.md"`: the benchmarks keep one page, beside
them. That file links to the docs as read in the repository (`../docs/performance.md`); on the site
its text sits in docs/, so the include drops that prefix, and mkdocs then checks every such link
and anchor as it checks the pages' own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', re.MULTILINE)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """The page's markdown, each `--8<-- "path"` line replaced by that repository file's text."""
    return INCLUDE.sub(lambda m: included(m["path"]), markdown)


def included(path: str) -> str:
    """The text of the repository file `path`, its links to docs/ made relative to docs/."""
    return (REPO / path).read_text().replace("](../docs/", "](")
