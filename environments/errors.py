"""The errors an environment author can cause, each naming what to fix.

All three are loud, user-caused failures (STYLE.md principle 7): a bad spec or class definition
stops the run before any episode starts; a reset or reward that breaks stops it with the class
and the row that broke it. Failures the *model* causes inside a tool call are not raised here:
the tools layer turns them into tool messages.
"""


class EnvironmentSpecError(ValueError):
    """An environment spec cannot be resolved, or a class breaks the Environment contract."""


class EnvironmentResetError(RuntimeError):
    """``reset`` could not be called with a row, raised, or returned neither str nor None."""


class EnvironmentRewardError(RuntimeError):
    """``reward`` raised, or returned something other than a finite number."""
