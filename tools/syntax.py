"""Parse Python source into a syntax tree, one thread at a time.

CPython up to 3.11.7 (the one CI runs) keeps the depth counter of its AST-to-object
conversion in per-interpreter state (CPython issue gh-106905, fixed by its pull request 113035
in later releases). When a thread switch lands inside one `ast.parse` (a garbage collection
running a finalizer is enough) and another thread parses meanwhile, the first raises
`SystemError: AST constructor recursion depth mismatch`. Tools run in worker threads while
the engine parses tool calls, so every parse this project does goes through
`parse_expression`, which holds one lock for the parse. The lock is re-entrant so that a
finalizer which parses on the same thread cannot deadlock.
"""

from __future__ import annotations

import ast
import threading

_PARSE_LOCK = threading.RLock()


def parse_expression(source: str) -> ast.Expression:
    """`ast.parse(source, mode="eval")`, serialized with every other parse of this project.

    Raises:
        SyntaxError: If `source` is not one Python expression (as `ast.parse` does).

    """
    with _PARSE_LOCK:
        return ast.parse(source, mode="eval")
