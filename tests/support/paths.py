"""Where things are, for tests that run scripts or read files by path (any folder deep)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SCRIPTS = TESTS / "scripts"  # the scripts tests run as subprocesses
SUPPORT = TESTS / "support"
