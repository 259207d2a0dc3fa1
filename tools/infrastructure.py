"""Infrastructure failures: the machinery behind a tool broke, not the model and not the user.

A sandbox that died, a server that timed out or dropped its connection: what such a failure
costs an episode says nothing about the model, so scoring it (a fake zero reward) would train on
noise, and stopping the run for it would make every preempted sandbox fatal. A tool, an
environment's ``__init__``, ``reset``, ``reward`` or tools, or the MCP tool wrapper
(`tools.mcp`) raises `InfrastructureError` to say so. `tools.call_tool` lets it through instead
of turning it into a message for the model; the rollout engine replays the episode from scratch
(`infra_retries` times), then keeps it as a failed episode that is neither scored nor trained on.

`infrastructure_failure` finds one inside what an episode raised: the environment wraps what
its methods raise in errors that name the method (``raise EnvironmentResetError(...) from
error``), and concurrent tool calls raise exception groups.
"""

from __future__ import annotations


class InfrastructureError(RuntimeError):
    """The infrastructure a tool or environment needs failed (a sandbox died, a server is gone).

    Raise it from a tool or an environment method only for failures the model did not cause
    and a replay of the episode may not meet. Anything else a tool raises is the model's to
    read (a tool message); anything else an environment method raises stops the run.

    Examples:
        >>> failure = RuntimeError("reset failed")
        >>> failure.__cause__ = InfrastructureError("sandbox preempted")
        >>> infrastructure_failure(failure)
        InfrastructureError('sandbox preempted')
        >>> infrastructure_failure(ValueError("bad row")) is None
        True

    """


def infrastructure_failure(error: BaseException) -> InfrastructureError | None:
    """The `InfrastructureError` behind `error`, or None when `error` is not one.

    It is `error` itself or one of its explicit causes (``raise ... from``, followed down the
    chain). An exception group is one when every exception in it is, and the first of them is
    returned: a group that also holds any other error is not, so that error stays loud.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, InfrastructureError):
            return current
        if isinstance(current, BaseExceptionGroup):
            found = [infrastructure_failure(inner) for inner in current.exceptions]
            return found[0] if all(found) else None
        current = current.__cause__
    return None
