"""Leaving the process when the command is done, whatever threads user code left running.

Python waits at exit for every non-daemon thread, and a thread an environment started (a
watcher, a server, a thread pool's worker stuck in a call) may never end; the command would
then hang after its last line. `exit_within`, armed by `agentgrpo.cli.command`, lets the
interpreter exit as usual (atexit handlers, buffered output), and ends the process itself if
that has not happened `grace_s` seconds later, saying which threads were still running.

A process that `accelerate launch` (torchrun) started also ends with its launcher
(`end_with_launcher`): killed, the launcher would otherwise leave it training on, unwatched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

EXIT_GRACE_S = 10.0
"""How long the interpreter may wait for leftover threads at exit before the process ends."""
LAUNCHER_POLL_S = 1.0
"""How often a launched process checks that its launcher is still there."""
STOP_GRACE_S = 60.0
"""How long a process whose launcher is gone may take to stop as on Ctrl-C before it is ended."""


def end_with_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """Under torchrun (`accelerate launch` of several processes), stop once the launcher is gone.

    torchrun's agent watches the processes it started: when one dies, it stops the others
    within seconds. Nothing watches the agent: killed (SIGKILL, the OOM killer), it would leave
    its processes training on, their output unread, their output folder locked against a
    relaunch. A daemon thread sees this process's parent change (the process was adopted)
    within `LAUNCHER_POLL_S`, says so, and sends the process SIGINT: it stops as on Ctrl-C, and
    is ended `STOP_GRACE_S` later if that has not happened. Outside torchrun it does nothing.
    """
    if "TORCHELASTIC_RUN_ID" not in environ:
        return
    launcher = os.getppid()
    threading.Thread(
        target=_stop_without, args=(launcher,), name="launcher watch", daemon=True
    ).start()


def _stop_without(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(LAUNCHER_POLL_S)
    print(
        f"agentgrpo: the launcher (pid {launcher}) that started this process is gone; "
        "stopping as on Ctrl-C",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(STOP_GRACE_S)
    print(f"agentgrpo: still running {STOP_GRACE_S:.0f} s later; ending", file=sys.stderr)
    _flush()
    os._exit(130)


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
