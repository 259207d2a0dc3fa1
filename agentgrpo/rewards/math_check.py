"""Math answers compared by math-verify, in a process of its own so that no answer can hang a run.

math-verify (the library TRL's `accuracy_reward` uses) reads LaTeX into sympy and decides whether
two answers are the same mathematical object. Some answers make sympy compute for minutes
(``10^{10^{10}}``), and math-verify's own time limit uses `signal.alarm`, which works only on a
process's main thread, while agentgrpo calls reward functions from worker threads. So
`MathChecker` sends each comparison to a child process (this module run as a script) and waits
at most `timeout_s`; a comparison that takes longer counts as not equal, and the child is
killed and started again on the next call.
"""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
import threading
from typing import IO

_READY = "ready"


class MathChecker:
    """Asks a child process running math-verify whether two LaTeX answers are equal.

    Thread-safe: one comparison runs at a time. The child starts on the first call and lives
    until the checker is closed or the parent exits.

    Args:
        timeout_s: The longest one comparison may take; past it, the answers are not equal.
        start_timeout_s: The longest the child may take to import math-verify.
    """

    def __init__(self, timeout_s: float = 5.0, start_timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._child: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def equal(self, gold: str, answer: str) -> bool:
        """Whether math-verify finds `answer` equal to `gold` (both LaTeX math, no ``$``)."""
        with self._lock:
            child = self._running()
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(json.dumps([gold, answer]) + "\n")
            child.stdin.flush()
            verdict = _read_line(child.stdout, self.timeout_s)
            if verdict is None:  # too slow, or the child died: start afresh next time
                self._stop()
                return False
            return verdict == "1"

    def close(self) -> None:
        """Stop the child process (a later call starts a new one)."""
        with self._lock:
            self._stop()

    def _running(self) -> subprocess.Popen[str]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._child = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self._child.stdout is not None
        if _read_line(self._child.stdout, self.start_timeout_s) != _READY:
            self._stop()
            raise RuntimeError(
                "the math-verify process did not start: is math-verify installed "
                "(pip install 'math-verify>=0.8')?"
            )
        return self._child

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


def _read_line(stream: IO[str], timeout_s: float) -> str | None:
    """The next line of `stream` without its newline; None after `timeout_s` or at its end."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    line = stream.readline() if ready else ""
    return line.rstrip("\n") if line else None


def _serve() -> None:
    """The child: read ``[gold, answer]`` lines, write ``1`` (equal) or ``0`` for each."""
    import logging

    from math_verify import LatexExtractionConfig, parse, verify

    logging.disable(logging.WARNING)  # its warning that time limits are off, on every call
    latex = [LatexExtractionConfig()]
    print(_READY, flush=True)
    for line in sys.stdin:
        gold, answer = json.loads(line)
        try:
            gold_parsed = parse(f"${gold}$", extraction_config=latex, parsing_timeout=None)
            answer_parsed = parse(f"${answer}$", extraction_config=latex, parsing_timeout=None)
            same = bool(gold_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=None))
        except Exception:  # odd input makes sympy raise many kinds: all mean "not shown equal"
            same = False
        print("1" if same else "0", flush=True)


if __name__ == "__main__":
    _serve()
