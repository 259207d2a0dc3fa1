"""Leaving the process when the command is done, whatever threads user code left running.

Python waits at exit for every non-daemon thread, and a thread an environment started (a
watcher, a server, a thread pool's worker stuck in a call) may never end; the command would
then hang after its last line. `exit_within`, armed by `agentgrpo.cli.command`, lets the
interpreter exit as usual (atexit handlers, buffered output), and ends the process itself if
that has not happened `grace_s` seconds later, saying which threads were still running.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

EXIT_GRACE_S = 10.0
"""How long the interpreter may wait for leftover threads at exit before the process ends."""


def exit_within(grace_s: float, status: int) -> None:
    """Arm a daemon watchdog that ends the process with `status` after `grace_s` seconds.

    Call it just before the interpreter exits: the output written so far is flushed first.
    """
    _flush()
    threading.Thread(
        target=_end_after, args=(grace_s, status), name="exit watchdog", daemon=True
    ).start()


def _end_after(grace_s: float, status: int) -> None:
    time.sleep(grace_s)
    main = threading.main_thread()
    names = [t.name for t in threading.enumerate() if not t.daemon and t is not main]
    print(
        f"warning: exiting although threads still run {grace_s:.0f} s after the command ended: "
        f"{', '.join(names) or 'none'} (started by user code? make them daemon threads, or "
        "stop them in the environment's close())",
        file=sys.stderr,
    )
    _flush()
    os._exit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        # OSError, ValueError: a broken pipe or a closed stream; nothing more can be written.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
