"""Driving one environment instance through an episode: create, reset, done, reward, close.

Each function wraps one optional or required member of the contract, so the rollout engine never
inspects user classes itself and every user mistake surfaces as one error that names the class
and the method. Whatever the user's method raises is its failure, ``SystemExit`` and
``KeyboardInterrupt`` included (`tools.threads.is_signal` says which are signals instead). The
functions are synchronous, like the contract's methods, except `read_reward`, which also
accepts an ``async def`` reward and so is awaited, `read_done`, which reads a ``done`` property
in a daemon thread, and `run_environment_code`, which runs any of them in a daemon thread under
the run's ``environment_timeout_s`` (`run_environment_code_blocking` outside an event loop).
"""

from __future__ import annotations

import functools
import inspect
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio

from environments.contract import reward_method_name
from environments.errors import (
    EnvironmentCloseError,
    EnvironmentDoneError,
    EnvironmentInitError,
    EnvironmentResetError,
    EnvironmentRewardError,
    EnvironmentSpecError,
    EnvironmentTimeoutError,
    async_method_message,
)
from tools.call import is_image
from tools.threads import (
    USER_CODE,
    CallTimedOut,
    StuckCallsError,
    describe_error,
    is_signal,
    run_in_daemon_thread,
)

_VALUE_CHARS = 60  # per column, when a row is shown in an error message
T = TypeVar("T")


async def run_environment_code(fn: Callable[[], T], where: str, timeout_s: float | None) -> T:
    """Run `fn()` (environment code) in a daemon thread and give up on it after `timeout_s`.

    Args:
        fn: The call, e.g. ``functools.partial(close_environment, env)``.
        where: Names the method in errors, e.g. ``"Game.close()"``.
        timeout_s: Seconds the call may take; None for no limit.

    Raises:
        EnvironmentTimeoutError: `fn` did not return in time; it is abandoned (it runs on in its
            thread, counted as stuck until it returns) and the message names `where`.
        StuckCallsError: Too many calls of user code are stuck to start another.

    """
    with anyio.move_on_after(timeout_s):
        return await run_in_daemon_thread(fn, label=where)
    raise EnvironmentTimeoutError(timed_out(where, timeout_s))


def run_environment_code_blocking(fn: Callable[[], T], where: str, timeout_s: float | None) -> T:
    """`run_environment_code` for callers outside an event loop: blocks this thread meanwhile.

    Raises:
        EnvironmentTimeoutError: As `run_environment_code`.
        StuckCallsError: As `run_environment_code`.

    """
    try:
        return USER_CODE.run_blocking(fn, where, timeout_s)
    except CallTimedOut:
        raise EnvironmentTimeoutError(timed_out(where, timeout_s)) from None


def timed_out(where: str, timeout_s: float | None) -> str:
    """The message of an `EnvironmentTimeoutError` for the method `where`."""
    return (
        f"{where} did not return within {timeout_s} s (environment_timeout_s); it was abandoned "
        "and may still run in a daemon thread. Make it return in time (give blocking I/O its "
        "own timeout) or raise environment_timeout_s."
    )


def create_environment(factory: Callable[[], Any]) -> object:
    """Make a fresh environment instance by calling the class (or zero-argument factory).

    Raises:
        EnvironmentInitError: The call raised (chained); the message names the class's
            ``__init__`` (or the factory).

    """
    try:
        return factory()
    except BaseException as error:
        if is_signal(error):
            raise
        where = init_name(factory)
        raise EnvironmentInitError(f"{where} raised {describe_error(error)}") from error


def init_name(factory: Callable[[], Any]) -> str:
    """How errors name the call that makes an instance: ``Game.__init__()`` or the factory."""
    if isinstance(factory, type):
        return f"{factory.__qualname__}.__init__()"
    return f"the environment factory {getattr(factory, '__qualname__', repr(factory))}()"


def reset_environment(
    env: object, row: Mapping[str, Any], seed: int | None
) -> str | list[Any] | None:
    """Start an episode: call ``env.reset`` with the row columns it names.

    Only the columns that ``reset`` names as parameters are passed (all of them if it takes
    ``**kwargs``), so a dataset can carry columns such as ``prompt`` that the environment
    ignores. ``seed=`` is passed when ``reset`` has a ``seed`` parameter or ``**kwargs``: the
    row's own ``seed`` column where it has one that is not None (the row names its game, as
    TRL passes it: a held-out split's seeds stay held out), else the `seed` argument. Either
    way the members of a group, which share a row, start from the same state.

    Args:
        env: A fresh environment instance.
        row: One dataset row, column name to value.
        seed: The group's seed, or None; used where the row has no seed of its own.

    Returns:
        What ``reset`` returned: text the engine appends to the last user message, or None;
        for a vision-language model also an image (a PIL image), or a list of texts and
        images (at least one), appended in order (an image alone comes back as a list).

    Raises:
        EnvironmentResetError: ``reset`` needs a column the row lacks, raised (chained), is
            ``async def``, or returned something other than ``str`` or None. The message names
            the class and shows the row.

    """
    name = type(env).__qualname__
    reset = getattr(env, "reset", None)
    if not callable(reset):
        raise EnvironmentResetError(f"{name} has no reset() method. Row: {_show(row)}")
    kwargs, missing = _reset_arguments(reset, row, seed)
    if missing:
        raise EnvironmentResetError(
            f"{name}.reset() needs {', '.join(map(repr, missing))}, which the row lacks; "
            f"give the parameter a default or add the column. Row: {_show(row)}"
        )
    try:
        text = reset(**kwargs)
    except BaseException as error:
        if is_signal(error):
            raise
        raise EnvironmentResetError(
            f"{name}.reset() raised {describe_error(error)}. Row: {_show(row)}"
        ) from error
    return _observation(name, text, row)


def _observation(name: str, text: Any, row: Mapping[str, Any]) -> str | list[Any] | None:
    """What class `name`'s ``reset`` returned, checked (see `reset_environment`)."""
    if inspect.iscoroutine(text):  # an async def reset: refused by check_environment too
        text.close()
        raise EnvironmentResetError(f"{async_method_message(name, 'reset')}. Row: {_show(row)}")
    if is_image(text):
        return [text]
    if _texts_and_images(text):
        return [_valid_text(name, v, row) if isinstance(v, str) else v for v in text]
    if text is not None and not isinstance(text, str):
        raise EnvironmentResetError(
            f"{name}.reset() returned {type(text).__name__}; it must return str (text appended "
            f"to the last user message), an image or a list of texts and images (for a "
            f"vision-language model), or None. Row: {_show(row)}"
        )
    return None if text is None else _valid_text(name, text, row)


def _texts_and_images(value: Any) -> bool:
    """Whether `value` is a list or tuple of texts and images, with at least one image."""
    return (
        isinstance(value, list | tuple)
        and any(is_image(v) for v in value)
        and all(isinstance(v, str) or is_image(v) for v in value)
    )


def _valid_text(name: str, text: str, row: Mapping[str, Any]) -> str:
    """`text`, or an `EnvironmentResetError` when it holds a lone surrogate."""
    if (bad := _lone_surrogate(text)) is not None:
        raise EnvironmentResetError(
            f"{name}.reset() returned text with a lone surrogate {text[bad]!r} at index {bad}, "
            "which no tokenizer can encode; return valid Unicode (e.g. decode bytes with "
            f"errors='replace'). Row: {_show(row)}"
        )
    return text


def _lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate (U+D800 to U+DFFF) in `text`, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


async def read_reward(env: object, timeout_s: float | None = None) -> float | None:
    """Read the episode reward from the environment's state; None if it defines no reward.

    The reward method is ``reward()`` (agentgrpo's name) or ``get_reward()`` (TRL's), sync or
    ``async def``, a method of the class: a ``reward`` attribute that is not one is the
    environment's own state, not read here. A sync one runs in a daemon thread
    (`tools.run_in_daemon_thread`), so a slow scorer never blocks the event loop.

    Args:
        env: The environment at the end of its episode (before `close_environment`).
        timeout_s: Seconds the method may take; None for no limit.

    Returns:
        The method's value as a finite float; None when the class defines neither method.

    Raises:
        EnvironmentSpecError: The class defines both ``reward`` and ``get_reward`` methods.
        EnvironmentRewardError: The instance hid the method, it raised (chained), or returned
            something that is not a finite number (a string, None, NaN, inf). A reward that
            fails is never scored 0.0: that would train on a wrong signal.
        EnvironmentTimeoutError: The method did not return within `timeout_s`.
        StuckCallsError: Too many calls of user code are stuck to start another.

    """
    method = _reward_method(env)
    if method is None:
        return None
    name = type(env).__qualname__
    where = f"{name}.{method.__name__}()"
    try:
        with anyio.move_on_after(timeout_s) as deadline:
            if inspect.iscoroutinefunction(method):
                value = await method()
            else:
                value = await run_in_daemon_thread(method, label=where)
    except StuckCallsError:
        raise
    except BaseException as error:
        if is_signal(error):
            raise
        raise EnvironmentRewardError(f"{where} raised {describe_error(error)}") from error
    if deadline.cancelled_caught:
        running = not inspect.iscoroutinefunction(method)  # a coroutine was cancelled, it stopped
        raise EnvironmentTimeoutError(timed_out(where, timeout_s), still_running=running)
    return _finite_float(value, name)


def _reward_method(env: object) -> Callable[[], Any] | None:
    """The bound reward method of `env`'s class (`reward_method_name`), or None."""
    method_name = reward_method_name(type(env))
    if method_name is None:
        return None
    method = getattr(env, method_name)
    if not callable(method):
        name = type(env).__qualname__
        raise EnvironmentRewardError(
            f"{name}.{method_name} is a method of the class, but the instance set an attribute "
            f"of that name over it ({type(method).__name__}); rename the attribute, e.g. "
            f"self.score, or the method"
        )
    return method


async def read_done(env: object, timeout_s: float | None = None) -> bool:
    """`is_done(env)`, with a property's code run in a daemon thread under `timeout_s`.

    A plain ``done`` attribute (or none) is read in place: it runs no user code, and the
    engine reads ``done`` after every turn's tool calls. Anything that may run the class's code
    on reading (a ``@property`` or other descriptor, ``__getattr__``, ``__getattribute__``) is
    read like the other methods of the contract, so one that blocks stalls no other episode.

    Raises:
        EnvironmentSpecError, EnvironmentDoneError: As `is_done`.
        EnvironmentTimeoutError: Reading ``done`` did not return within `timeout_s`.
        StuckCallsError: Too many calls of user code are stuck to start another.

    """
    if not done_runs_code(env):
        return is_done(env)
    where = f"{type(env).__qualname__}.done (a property)"
    return await run_environment_code(functools.partial(is_done, env), where, timeout_s)


def done_runs_code(env: object) -> bool:
    """Whether reading ``env.done`` may run code of the class, not just look a value up.

    >>> class Plain:
    ...     done = False
    >>> class Computed:
    ...     @property
    ...     def done(self) -> bool:
    ...         return True
    >>> done_runs_code(Plain()), done_runs_code(Computed()), done_runs_code(object())
    (False, True, False)
    """
    cls = type(env)
    if cls.__getattribute__ is not object.__getattribute__:
        return True
    try:
        found = inspect.getattr_static(env, "done")
    except AttributeError:
        return hasattr(cls, "__getattr__")
    if inspect.isfunction(found) or isinstance(found, types.MemberDescriptorType):
        return False  # a method (an error `is_done` reports) or a __slots__ slot: no user code
    return hasattr(type(found), "__get__")


def is_done(env: object) -> bool:
    """Whether the environment asked to end the episode by setting ``done`` to a true value.

    Raises:
        EnvironmentSpecError: ``done`` is a method, which would always read as true.
        EnvironmentDoneError: Reading ``done`` (a property) raised, or its value has no truth
            (``bool()`` raised, e.g. a numpy array of several elements); chained.

    """
    name = type(env).__qualname__
    try:
        done = getattr(env, "done", False)
    except BaseException as error:
        if is_signal(error):
            raise
        raise EnvironmentDoneError(f"{name}.done raised {describe_error(error)}") from error
    if inspect.ismethod(done):
        raise EnvironmentSpecError(
            f"{name}.done is a method; make it a bool attribute or @property"
        )
    return _truth(done, name)


def _truth(done: object, name: str) -> bool:
    """`bool(done)`, or an `EnvironmentDoneError` naming the class when it has no truth value."""
    try:
        return bool(done)
    except BaseException as error:
        if is_signal(error):
            raise
        raise EnvironmentDoneError(
            f"{name}.done is a {type(done).__name__} whose truth cannot be told "
            f"({describe_error(error)}); set it to a bool, e.g. self.done = bool(...)"
        ) from error


def close_environment(env: object) -> None:
    """Call ``env.close()`` if the class defines it.

    Raises:
        EnvironmentCloseError: ``close`` raised (chained); the message names the class.
        EnvironmentSpecError: ``close`` is ``async def``; the contract's methods are synchronous.

    """
    close = getattr(env, "close", None)
    if not callable(close):
        return
    name = type(env).__qualname__
    try:
        result = close()
    except BaseException as error:
        if is_signal(error):
            raise
        raise EnvironmentCloseError(f"{name}.close() raised {describe_error(error)}") from error
    if inspect.iscoroutine(result):
        result.close()
        raise EnvironmentSpecError(async_method_message(name, "close"))


def close_after_failure(env: object, failure: BaseException) -> None:
    """Close `env` after `failure` ended its episode, leaving `failure` the error to raise.

    The first cause is what the user must see: if closing fails too, its error is added to
    `failure` as a note (``failure.__notes__``) instead of replacing it.
    """
    try:
        close_environment(env)
    except (EnvironmentCloseError, EnvironmentSpecError) as close_error:
        add_close_note(failure, close_error)


def add_close_note(failure: BaseException, close_error: BaseException) -> None:
    """Note on `failure` that closing the environment then failed too (see above)."""
    failure.add_note(f"Closing the environment then failed too: {close_error}")


def _reset_arguments(
    reset: Callable[..., Any], row: Mapping[str, Any], seed: int | None
) -> tuple[dict[str, Any], list[str]]:
    """Pick the keyword arguments for ``reset``; also list required parameters left unfilled."""
    try:
        parameters = inspect.signature(reset).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: pass everything
        return {**row, "seed": _own_seed(row, seed)}, []
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {p.name: p for p in parameters if p.kind in by_name}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    kwargs = {key: value for key, value in row.items() if takes_any or key in named}
    if takes_any or "seed" in named:
        kwargs["seed"] = _own_seed(row, seed)
    missing = [p.name for p in named.values() if p.default is p.empty and p.name not in kwargs]
    return kwargs, missing


def _own_seed(row: Mapping[str, Any], seed: int | None) -> int | None:
    """The seed a row's episodes reset with: its ``seed`` column where not None, else `seed`.

    Examples:
        >>> _own_seed({"seed": 1_000_000}, 7), _own_seed({"seed": None}, 7), _own_seed({}, None)
        (1000000, 7, None)

    """
    own = row.get("seed")
    return seed if own is None else own


def _finite_float(value: object, name: str) -> float:
    problem = f"{name}.reward() returned {_shown_value(value)}"
    if isinstance(value, str | bytes):  # float("1") would succeed and hide the bug
        raise EnvironmentRewardError(f"{problem}, a string; return a float")
    _close_if_coroutine(value)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError) as error:
        raise EnvironmentRewardError(
            f"{problem} ({type(value).__name__}); return a float, synchronously"
        ) from error
    if not math.isfinite(number):
        raise EnvironmentRewardError(f"{problem}; a reward must be finite")
    return number


def _shown_value(value: object) -> str:
    """`repr(value)` cut short, or its type where repr fails (an int past 4,300 digits)."""
    try:
        return f"{value!r:.{_VALUE_CHARS}}"
    except Exception:
        return f"a {type(value).__name__} that cannot be shown"


def _close_if_coroutine(value: object) -> None:
    """Close an un-awaited coroutine so Python does not also warn "never awaited"."""
    if inspect.iscoroutine(value):
        value.close()


def _show(row: Mapping[str, Any]) -> str:
    """Show the row as ``{column: repr}``, each value cut to a readable length."""
    shown = []
    for key, value in row.items():
        text = repr(value)
        if len(text) > _VALUE_CHARS:
            text = text[: _VALUE_CHARS - 3] + "..."
        shown.append(f"{key!r}: {text}")
    return "{" + ", ".join(shown) + "}"
