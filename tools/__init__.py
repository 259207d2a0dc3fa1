"""Tools the model can call: schemas from typed docstringed callables, safe calls, built-ins.

`as_tool(fn)` turns a typed, Google-docstringed function, async function or bound method into a
`Tool` whose schema the chat template shows the model. `await call_tool(tools, name, arguments,
timeout_s)` validates the model's arguments and calls the tool, and never raises for a failure
the model caused: it returns a `ToolResult` with `error` set and a message the model can act on.
A tool that returns `Rewarded(value, reward)` gives its step a reward: the model reads `value`,
and the engine adds `reward` to the turn's (`tools.rewarded`).

Built-in tools: `calculator` (safe arithmetic) and `python` (runs model-written Python in a
sandbox: wall-clock, CPU, memory, process, file-size and output limits; no network, and only
a private working folder plus read-only system paths in view, through Linux namespaces; where
those do not work it refuses with `SandboxUnavailableError` unless made with `isolation="none"`;
see `tools.sandbox` for exactly what is and is not guaranteed). `python_tool(timeout_s=...,
memory_mb=..., ...)` makes a `python` tool with other limits.

`InfrastructureError` is what a tool (or an environment) raises when the machinery behind it
failed, a sandbox that died or a server that is gone: `call_tool` lets it through, and the
episode is replayed rather than shown the error or scored (`tools.infrastructure`).

`run_in_daemon_thread` runs user code where a call that never returns cannot hold the process.
This package imports nothing from `environments`, `rollout` or `agentgrpo`.
"""

from tools.calculator import calculator
from tools.call import (
    ToolErrorKind,
    ToolResult,
    ToolResultError,
    call_problems,
    call_tool,
    is_image,
    picture_problem,
)
from tools.infrastructure import InfrastructureError, infrastructure_failure
from tools.python import python, python_tool
from tools.rewarded import Rewarded, ToolRewardError
from tools.sandbox import SandboxUnavailableError
from tools.schema import Tool, ToolDefinitionError, as_tool
from tools.threads import StuckCallsError, UserCodeAborted, run_in_daemon_thread

__all__ = [
    "InfrastructureError",
    "Rewarded",
    "SandboxUnavailableError",
    "StuckCallsError",
    "Tool",
    "ToolDefinitionError",
    "ToolErrorKind",
    "ToolResult",
    "ToolResultError",
    "ToolRewardError",
    "UserCodeAborted",
    "as_tool",
    "calculator",
    "call_problems",
    "call_tool",
    "infrastructure_failure",
    "is_image",
    "picture_problem",
    "python",
    "python_tool",
    "run_in_daemon_thread",
]
