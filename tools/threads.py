"""Run user code (sync tools, environment methods) in daemon threads a run can walk away from.

Contract of `run_in_daemon_thread(fn, label)`:

- `fn` runs in a new daemon thread and its outcome is awaited from anyio, so the event loop never
  blocks on it and, when the wait is cancelled (a tool's timeout, a run that ends), the caller
  gets the cancellation at once. The call is then *abandoned*, not stopped: its thread runs on
  until `fn` returns. A daemon thread never keeps the interpreter alive at exit, so a process
  ends promptly whatever its tools do.
- Abandoned calls still running are *stuck*. Each holds a thread for ever, so at most
  `MAX_STUCK_CALLS` may be: starting one more call raises `StuckCallsError`, which names them
  (their labels). That is the user's problem to fix, not the model's: their code ignores its
  timeout.
- `DaemonThreads.run_blocking(fn, label, timeout_s)` is the same for a caller outside any event
  loop (setting a run up): it blocks the calling thread up to `timeout_s`, then abandons `fn`.
- Whatever `fn` raises is `fn`'s own failure. An `Exception` comes back as it is; a
  `BaseException` that is not one (`SystemExit`, `KeyboardInterrupt`, ...) comes back as
  `UserCodeAborted`, an `Exception`, so the framework never takes it for a signal. (Python
  delivers Ctrl-C to the main thread only, so nothing raised in a worker thread is one.)

`is_signal` draws the same line for user code that runs in place (async tools, a method called
directly): the cancellation of the current task and a `KeyboardInterrupt` on the main thread
are signals to the framework and must propagate; anything else user code raises is that code's
failure, a `CancelledError` of some other task's included.

`shield_unless_interrupted()` is a shielded cancel scope for waits that must outlast their
task's cancellation (closing an environment after its episode failed) but not a Ctrl-C: a shield
also stops the cancellation asyncio delivers on the first Ctrl-C, which would then be ignored
for as long as the wait lasts. While such a scope is open in the main thread, a SIGINT cancels it
first, then does what the handler it stands in front of does (asyncio's: cancel the main task;
Python's default: raise `KeyboardInterrupt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

T = TypeVar("T")

MAX_STUCK_CALLS = 32
"""The most abandoned calls that may still run before another call is refused."""

WAKE_EVERY_S = 0.5
"""How often a thread blocked waiting for another wakes, to run a pending Ctrl-C's handler.

CPython runs a signal's handler between bytecodes, and a thread blocked on a lock wakes only for
a signal that arrives while it waits: a Ctrl-C that lands just before the main thread blocks is
otherwise handled only when the wait ends, which may be never.
"""


class StuckCallsError(RuntimeError):
    """Too many calls of user code were abandoned and still run; the message names them."""


class CallTimedOut(TimeoutError):
    """`DaemonThreads.run_blocking` gave up waiting; the call runs on, counted as stuck."""


class UserCodeAborted(Exception):
    """User code raised a `BaseException` that is not an `Exception`, e.g. `SystemExit`.

    Attributes:
        raised: What the code raised; also the `__cause__`.

    """

    def __init__(self, raised: BaseException):
        super().__init__(describe_error(raised))
        self.raised = raised


def describe_error(error: BaseException) -> str:
    """``"TypeName: message"`` (or the type name alone) of what user code raised.

    Sees through `UserCodeAborted`, so a tool that called `sys.exit(3)` reads ``SystemExit: 3``.
    """
    if isinstance(error, UserCodeAborted):
        error = error.raised
    try:
        text = str(error)
    except Exception:  # its own __str__ fails: the type is all there is to say
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def is_signal(error: BaseException) -> bool:
    """Whether `error`, raised out of user code, is a signal to the framework, not a failure.

    Signals are the cancellation of the current task (anyio's cancel scopes, a task group
    that ends, asyncio's first Ctrl-C) and a `KeyboardInterrupt` raised on the main thread,
    where a real Ctrl-C arrives. Everything else, `SystemExit` included, is the failure of the
    code that raised it, and so is a `CancelledError` while the current task is not being
    cancelled: on asyncio it is an ordinary exception, e.g. an inner task the code awaited was
    cancelled (see `_cancelling`).
    """
    if isinstance(error, KeyboardInterrupt):
        return threading.current_thread() is threading.main_thread()
    try:
        cancelled = anyio.get_cancelled_exc_class()
    except RuntimeError:  # no event loop in this thread: nothing here can be cancelled
        return False
    return isinstance(error, cancelled) and _cancelling(cancelled)


def _cancelling(cancelled: type[BaseException]) -> bool:
    """Whether the current task is being cancelled, given the event loop's cancelled class.

    On asyncio every cancellation of a task (anyio delivers a cancel scope's with
    `Task.cancel()`, as asyncio does a Ctrl-C) counts in `Task.cancelling()` until the scope
    that asked for it has handled it. trio's `Cancelled` cannot be raised by user code at all,
    so there it is always trio's own cancellation.
    """
    if cancelled is not asyncio.CancelledError:
        return True
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@dataclass(eq=False)
class _Call:
    """One call's label and outcome; compared by identity, so it can sit in a set."""

    label: str
    value: Any = None
    error: BaseException | None = None
    finished: bool = False

    def outcome(self) -> Any:
        """The value `fn` returned, or raise what it raised (see the module contract)."""
        if self.error is None:
            return self.value
        if isinstance(self.error, Exception):
            raise self.error
        raise UserCodeAborted(self.error) from self.error


class DaemonThreads:
    """Runs sync callables in daemon threads and counts the abandoned ones still running.

    Args:
        max_stuck: The most abandoned calls that may still run; one more call is refused.

    """

    def __init__(self, max_stuck: int = MAX_STUCK_CALLS):
        self.max_stuck = max_stuck
        self._lock = threading.Lock()
        self._stuck: set[_Call] = set()

    @property
    def stuck(self) -> list[str]:
        """The labels of the abandoned calls that are still running."""
        with self._lock:
            return sorted(call.label for call in self._stuck)

    async def run(self, fn: Callable[[], T], label: str) -> T:
        """Run `fn()` in a new daemon thread and return its value (see the module contract).

        Args:
            fn: The user code, a callable taking no arguments.
            label: Names the code in errors, e.g. ``"tool lookup()"`` or ``"Game.reset()"``.

        Raises:
            StuckCallsError: `max_stuck` abandoned calls are still running; `fn` is not run.
            UserCodeAborted: `fn` raised a `BaseException` that is not an `Exception`.

        """
        self._refuse_if_full()
        call = _Call(label)
        done = anyio.Event()
        token = anyio.lowlevel.current_token()
        args = (fn, call, lambda: anyio.from_thread.run_sync(done.set, token=token))
        threading.Thread(target=self._target, args=args, name=label, daemon=True).start()
        try:
            await done.wait()
        except BaseException:  # cancelled: leave the thread to finish on its own
            with self._lock:
                if not call.finished:
                    self._stuck.add(call)
            raise
        return call.outcome()

    def run_blocking(self, fn: Callable[[], T], label: str, timeout_s: float | None) -> T:
        """`run`, for synchronous callers: block this thread until `fn` returns or `timeout_s`.

        For user code called outside any event loop (e.g. while a run is set up). A Ctrl-C
        while waiting abandons the call as a timeout does.

        Raises:
            CallTimedOut: `fn` did not return within `timeout_s`; it is abandoned (stuck).
            StuckCallsError: `max_stuck` abandoned calls are still running; `fn` is not run.
            UserCodeAborted: `fn` raised a `BaseException` that is not an `Exception`.

        """
        self._refuse_if_full()
        call, done = _Call(label), threading.Event()
        args = (fn, call, done.set)
        threading.Thread(target=self._target, args=args, name=label, daemon=True).start()
        try:
            wait_waking(done, timeout_s)
        finally:  # on time out or Ctrl-C, leave the thread to finish on its own
            with self._lock:
                finished = call.finished
                if not finished:
                    self._stuck.add(call)
        if not finished:
            raise CallTimedOut(f"{label} did not return within {timeout_s} s")
        return call.outcome()

    def _target(self, fn: Callable[[], Any], call: _Call, wake: Callable[[], None]) -> None:
        """The thread's body: run `fn`, record its outcome, wake the waiting task if any."""
        try:
            call.value = fn()
        except BaseException as raised:  # all of it is fn's own failure (module contract)
            call.error = raised
        with self._lock:
            call.finished = True
            self._stuck.discard(call)
        # RuntimeError (anyio.RunFinishedError): the event loop has ended, nobody waits any more.
        with contextlib.suppress(RuntimeError):
            wake()

    def _refuse_if_full(self) -> None:
        labels = self.stuck
        if len(labels) < self.max_stuck:
            return
        counts = ", ".join(f"{label} x{n}" for label, n in Counter(labels).most_common())
        raise StuckCallsError(
            f"{len(labels)} calls of user code are stuck: they timed out or were cancelled and "
            f"are still running ({counts}). Each holds a thread for ever; make the code return "
            "in time (e.g. give blocking I/O its own timeout, shorter than tool_timeout_s)."
        )


USER_CODE = DaemonThreads()
"""The process's daemon threads for user code; its `max_stuck` is `MAX_STUCK_CALLS`."""


def wait_waking(event: threading.Event, timeout_s: float | None) -> bool:
    """`event.wait(timeout_s)`, waking every `WAKE_EVERY_S` so that a Ctrl-C is never held."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not event.is_set():
        left = WAKE_EVERY_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return False
        event.wait(min(left, WAKE_EVERY_S))
    return True


async def run_in_daemon_thread(fn: Callable[[], T], label: str) -> T:
    """`USER_CODE.run(fn, label)`: run user code in a daemon thread (see the module contract)."""
    return await USER_CODE.run(fn, label)


@dataclass(eq=False)
class _Shield:
    """An open `shield_unless_interrupted` scope and the event loop it runs in."""

    scope: anyio.CancelScope
    token: Any


_SHIELDS: set[_Shield] = set()  # open in the main thread; only that thread changes the set
_BEFORE_US: list[Any] = []  # the SIGINT handler ours stands in front of, while ours is installed


@contextlib.contextmanager
def shield_unless_interrupted() -> Iterator[anyio.CancelScope]:
    """A shielded `anyio.CancelScope` that a Ctrl-C (SIGINT) still cancels (module contract).

    Outside the main thread, where no signal handler can be set (nor a Ctrl-C arrive), it is a
    plain shielded scope. Deadlines set inside it still apply.
    """
    with anyio.CancelScope(shield=True) as scope:
        if threading.current_thread() is not threading.main_thread():
            yield scope
            return
        shield = _Shield(scope, anyio.lowlevel.current_token())
        if not _SHIELDS and callable(before := signal.getsignal(signal.SIGINT)):
            _BEFORE_US.append(before)
            signal.signal(signal.SIGINT, _cancel_shields_then_pass_on)
        _SHIELDS.add(shield)
        try:
            yield scope
        finally:
            _SHIELDS.discard(shield)
            if not _SHIELDS and _BEFORE_US:
                signal.signal(signal.SIGINT, _BEFORE_US.pop())


def _cancel_shields_then_pass_on(signum: int, frame: Any) -> None:
    """SIGINT while shields are open: cancel them all, then call the handler we stand in for.

    A signal handler runs in the middle of whatever the main thread was doing, the event loop
    included, so the scopes are cancelled from a helper thread through the loop's own queue.
    """
    shields = list(_SHIELDS)
    threading.Thread(target=_cancel, args=(shields,), name="cancel shields", daemon=True).start()
    (_BEFORE_US[-1] if _BEFORE_US else signal.default_int_handler)(signum, frame)


def _cancel(shields: list[_Shield]) -> None:
    for shield in shields:
        # RuntimeError (anyio.RunFinishedError): that event loop has ended; nothing to cancel.
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(shield.scope.cancel, token=shield.token)
