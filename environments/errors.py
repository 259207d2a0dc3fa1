"""The errors an environment author can cause, each naming what to fix.

All are loud, user-caused failures (STYLE.md principle 7): a bad spec or class definition stops
the run before any episode starts; an ``__init__``, ``reset``, ``reward`` or ``close`` that breaks
stops it with a message naming the class and the method (and, for ``reset``, the row), and so does
one that does not return within ``environment_timeout_s``. Anything
the method raises counts, ``SystemExit`` and ``KeyboardInterrupt`` included: in user code they
are that code's failure, not a signal to the framework. Failures the *model* causes inside a
tool call are not raised here: the tools layer turns them into tool messages.
"""


class EnvironmentSpecError(ValueError):
    """An environment spec cannot be resolved, or a class breaks the Environment contract."""


class EnvironmentInitError(RuntimeError):
    """Making an environment instance (the class's ``__init__``, or the factory) raised."""


class EnvironmentResetError(RuntimeError):
    """``reset`` could not be called with a row, raised, or returned neither str nor None."""


class EnvironmentRewardError(RuntimeError):
    """``reward`` raised, or returned something other than a finite number."""


class EnvironmentRespondError(RuntimeError):
    """``respond`` raised, or returned neither text nor None."""


class EnvironmentCloseError(RuntimeError):
    """``close`` raised.

    When an episode has already failed (e.g. ``reset`` raised), that first error is the one
    raised, and the close failure is added to it as a note (``__notes__``).
    """


class EnvironmentDoneError(RuntimeError):
    """Reading ``done`` (a property) raised, or its value has no truth (``bool()`` raised)."""


class EnvironmentTimeoutError(RuntimeError):
    """``__init__``, ``reset``, ``done``, ``reward`` or ``close`` did not return in time.

    A sync method is abandoned, not stopped: it runs on in its daemon thread (`tools.threads`),
    and `still_running` is True. An ``async def`` reward is cancelled (`still_running` False).
    """

    def __init__(self, message: str, still_running: bool = True):
        super().__init__(message)
        self.still_running = still_running


def async_method_message(name: str, member: str) -> str:
    """Why class `name`'s ``async def`` `member` (``reset``, ``close``) is refused; the fix."""
    return (
        f"{name}.{member}() is async; make it a plain method (`def {member}`): the engine "
        "runs reset, respond and close synchronously, in a daemon thread (only tools and reward "
        "may be async def)"
    )


def both_rewards_message(name: str) -> str:
    """Why class `name`, which defines both ``reward`` and ``get_reward``, is refused."""
    return f"{name} defines both reward() and get_reward(); keep one (they mean the same)"
