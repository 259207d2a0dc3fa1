"""MCP servers as tools: a server's tools become tools the model may call, through its session.

`McpServer.parse("python server.py --flag")` (or a URL, or a dict) says where a Model Context
Protocol server is; `McpTools([server, ...])` starts or reaches each one, lists its tools and
offers them as `Tool`s, and `close()` stops them. The protocol is the `mcp` package's (its
`Client`, over `stdio_client` or streamable HTTP); nothing of it is reimplemented here.

Contract:

- A stdio server is started as a subprocess of its command; it sees the `mcp` package's safe
  subset of this process's environment (`PATH`, `HOME`, `USER`, ...) plus the spec's `env`.
  Its stderr goes to a temporary file, whose end is quoted when the server fails to start. An
  HTTP server (an `http://` or `https://` URL, streamable HTTP) is reached, never started.
- Every server is opened once when `McpTools` is made, and its tools listed: the tools'
  schemas are what the chat template shows, so they are read before any episode plays. A
  shared server (the default) then serves all episodes and every round until `close()`; calls
  from different episodes run concurrently, as the server allows. A per-episode server
  (`McpServer.per_episode`, `"per_episode": true` in its spec) is stopped once listed; each
  episode, inside `McpTools.episode()`, starts its own (an HTTP one: opens a session of its
  own), which its calls reach and which is stopped when the episode ends, however it ends. The
  sessions live on event loops of their own, in daemon threads, so that calls from any event
  loop (each round's `anyio.run`, the asynchronous producer's thread) reach them.
- A tool is `{"type": "function", "function": {"name", "description", "parameters"}}` with the
  server's input schema as `parameters`; `tools.call_tool` checks the model's arguments against
  it before the call reaches the server. The result's text blocks, one a line, are the tool
  message (structured content as JSON when there is no text). A result the server marks as an
  error raises `McpToolError` with the server's text, which `call_tool` turns into an error
  message the model reads. A call that times out is cancelled on the server's session too. A
  call whose server is gone (its connection closed) raises `InfrastructureError`: the episode
  is replayed, not shown the error (`tools.infrastructure`).
- `close()` stops every stdio server, shared or per-episode (stdin closed, then SIGTERM, then
  SIGKILL, as the `mcp` package does) and ends HTTP sessions. It is idempotent, and also runs
  when the `McpTools` is garbage collected and at interpreter exit, so a server never outlives
  the process that started it, whether the run ended, failed or was interrupted. A server that
  cannot start, answer or list its tools within `timeout_s` raises `McpServerError` naming it;
  every server already started is stopped first. A per-episode server that fails so for one
  episode raises `InfrastructureError` instead: it started when the run did, so the episode is
  replayed.

The `mcp` package is imported only when a server is opened: `import tools` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TextIO, cast

import anyio
from anyio.from_thread import BlockingPortal

from tools.infrastructure import InfrastructureError
from tools.mcp_spec import OPTION, McpServer, mcp_servers_of, require_mcp
from tools.schema import Tool
from tools.threads import shield_unless_interrupted

__all__ = [
    "OPTION",
    "McpServer",
    "McpServerError",
    "McpToolError",
    "McpTools",
    "mcp_servers_of",
]

_STDERR_TAIL_CHARS = 2000  # how much of a server's stderr a start-up failure quotes
_CONNECTION_CLOSED = -32000  # the MCP error code of a session whose server is gone
_STOP_WAIT_S = 15.0  # longer than the mcp package's stdin, SIGTERM and SIGKILL waits together


class McpServerError(RuntimeError):
    """An MCP server could not be started, reached, or asked for its tools (the user's to fix)."""


class McpToolError(Exception):
    """An MCP server answered a tool call with an error; the message is the server's text."""


class McpTools:
    """MCP servers held open, their tools offered as `Tool`s, until `close()`.

    A shared server (`McpServer.per_episode` False) is opened here and held until `close()`. A
    per-episode server is opened here only to list its tools, then stopped; `episode()` opens
    one of each for every episode, and its tools reach the server of the episode they are
    called in.

    Args:
        servers: The servers, in order; their tool names must all differ.
        timeout_s: Seconds the shared servers together, and the per-episode ones together, may
            each take to start and list their tools; None for no limit.

    Attributes:
        tools: Every server's tools by name, in the servers' order.

    Raises:
        McpServerError: A server did not start, answer or list its tools in time.
        ValueError: Two servers offer a tool of one name (the model could call only one), or
            the `mcp` package is not installed.
    """

    def __init__(self, servers: Sequence[McpServer], timeout_s: float | None = 60.0):
        require_mcp(OPTION)
        self._own = tuple(server for server in servers if server.per_episode)
        self._timeout_s = timeout_s
        self._loops: list[_ServerLoop] = []  # open: the shared servers', then episodes'
        self._lock = threading.Lock()
        self._closed = False
        self._current: ContextVar[_ServerLoop | None] = ContextVar(f"mcp-{id(self)}", default=None)
        weakref.finalize(self, _stop_all, self._loops, self._lock)
        self.tools: dict[str, Tool] = {}
        self._own_names: frozenset[str] = frozenset()  # the per-episode servers' tools
        try:
            if shared := tuple(server for server in servers if not server.per_episode):
                self._loops.append(loop := _ServerLoop(shared, timeout_s))
                self._offer(loop, shared, lambda tool: tool)
            if self._own:  # each per-episode server once, for its tools: stopped at once
                probe = _ServerLoop(self._own, timeout_s)
                probe.stop()
                self._offer(probe, self._own, self._episode_tool)
                self._own_names = frozenset(probe.tools)
        except BaseException:
            self.close()
            raise

    def _offer(
        self, loop: _ServerLoop, servers: Sequence[McpServer], tool_of: Callable[[Tool], Tool]
    ) -> None:
        for server in servers:
            for name in loop.offered[server]:
                if name in self.tools:
                    raise ValueError(_clash(name, server))
                self.tools[name] = tool_of(loop.tools[name])

    def _episode_tool(self, listed: Tool) -> Tool:
        """A per-episode server's tool: a call reaches the server of the episode it is in."""
        name = listed.name

        async def call(**arguments: Any) -> str:
            loop = self._current.get()
            if loop is None:
                raise McpServerError(
                    f"MCP tool {name}() is a per-episode server's (per_episode): it is called "
                    "only inside McpTools.episode(), where the episode's own server runs"
                )
            result: str = await loop.tools[name].fn(**arguments)
            return result

        call.__name__ = call.__qualname__ = name
        return Tool(name=name, schema=listed.schema, fn=call)

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[None]:
        """Hold the per-episode servers of one episode open while the block runs.

        Each per-episode server is started (or, over HTTP, gets a session) on the way in; the
        tools called inside the block, in the task that entered it and the tasks it starts,
        reach them. On the way out, however the block ends (returned, raised, cancelled), they
        are stopped, and the way out waits for that (a Ctrl-C does not). Without per-episode
        servers it does nothing.

        Raises:
            InfrastructureError: A per-episode server did not start or list its tools in time
                (it did when the run started, so the episode may be replayed).
            McpServerError: It no longer offers a tool it listed when the run started.
        """
        if not self._own:
            yield
            return
        with shield_unless_interrupted():
            loop = await anyio.to_thread.run_sync(self._open_episode, abandon_on_cancel=True)
        token = self._current.set(loop)
        try:
            yield
        finally:
            self._current.reset(token)
            with shield_unless_interrupted():
                await anyio.to_thread.run_sync(self._stop, loop, abandon_on_cancel=True)

    def _open_episode(self) -> _ServerLoop:
        try:
            loop = _ServerLoop(self._own, self._timeout_s)
        except McpServerError as error:
            raise InfrastructureError(f"a per-episode MCP server failed: {error}") from error
        with self._lock:
            self._loops.append(loop)
            closed = self._closed
        missing = sorted(self._own_names - loop.tools.keys())
        if closed or missing:
            self._stop(loop)
            why = "McpTools was closed" if closed else f"it no longer offers tools {missing}"
            raise McpServerError(f"a per-episode MCP server ({OPTION}) cannot serve: {why}")
        return loop

    def _stop(self, loop: _ServerLoop) -> None:
        loop.stop()
        with self._lock, contextlib.suppress(ValueError):
            self._loops.remove(loop)

    def close(self) -> None:
        """Stop every server, shared and per-episode; a second call does nothing."""
        with self._lock:
            self._closed = True
        _stop_all(self._loops, self._lock)

    def __enter__(self) -> McpTools:
        """Use as `with McpTools(servers) as mcp: ...`: closed on the way out."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close on the way out, whatever happened."""
        self.close()


def _stop_all(loops: list[_ServerLoop], lock: threading.Lock) -> None:
    """Stop every loop of `loops` (an `McpTools`'s, also at garbage collection and exit)."""
    with lock:
        stopping = list(loops)
    for loop in stopping:
        loop.stop()


def _clash(name: str, server: McpServer) -> str:
    return (
        f"two MCP servers ({OPTION}) offer a tool named {name!r}, the second {str(server)!r}; "
        "the model could call only one: drop one of the servers"
    )


class _ServerLoop:
    """An anyio event loop in a daemon thread that holds the sessions open until `stop()`."""

    def __init__(self, servers: tuple[McpServer, ...], timeout_s: float | None):
        self._servers, self._timeout_s = servers, timeout_s
        self._started: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._stopping = threading.Lock()
        self._portal: BlockingPortal | None = None
        self._close_sessions: anyio.Event | None = None
        self.tools: dict[str, Tool] = {}
        self.offered: dict[McpServer, list[str]] = {}  # each server's tool names, in order
        self._opening: McpServer | None = None  # the server being started, for errors
        self._thread = threading.Thread(target=self._run, name="mcp-servers", daemon=True)
        self._thread.start()
        if (failure := self._started.get()) is not None:
            self._thread.join()
            raise failure

    def _run(self) -> None:
        """The thread: the loop runs until `stop()`; a failure to start goes to the caller."""
        try:
            anyio.run(self._serve)
        except TimeoutError:
            self._started.put(
                McpServerError(
                    f"MCP server {str(self._opening)!r} ({OPTION}) did not start and list its "
                    f"tools within {self._timeout_s} s; check that the command serves MCP on "
                    "stdio (or that the URL answers), or allow more time"
                )
            )
        except BaseException as failure:  # reaches the caller's thread, raised there
            while isinstance(failure, BaseExceptionGroup) and len(failure.exceptions) == 1:
                failure = failure.exceptions[0]  # the portal's task group wraps what it meets
            self._started.put(failure)

    async def _serve(self) -> None:
        """Open every session, hand the tools over, and hold them open until `stop()`."""
        with anyio.fail_after(self._timeout_s) as opening:  # outermost: its error unwrapped
            async with BlockingPortal() as portal, contextlib.AsyncExitStack() as stack:
                for server in self._servers:
                    self._opening = server
                    self._add_tools(server, await _open(server, stack), portal)
                opening.deadline = math.inf
                self._portal, self._close_sessions = portal, anyio.Event()
                self._started.put(None)
                await self._close_sessions.wait()

    def _add_tools(self, server: McpServer, opened: _Opened, portal: BlockingPortal) -> None:
        for listed in opened.tools:
            if listed.name in self.tools:
                raise ValueError(_clash(listed.name, server))
            self.tools[listed.name] = _as_tool(listed, opened.client, portal)
        self.offered[server] = [listed.name for listed in opened.tools]

    def stop(self) -> None:
        """Close every session and end the thread; waits for the stdio servers to exit."""
        with self._stopping:
            portal, self._portal = self._portal, None
            if portal is None:
                return
            with contextlib.suppress(RuntimeError):  # the loop is already gone
                portal.call(self._set_closing)
            self._thread.join(_STOP_WAIT_S)

    def _set_closing(self) -> None:
        assert self._close_sessions is not None
        self._close_sessions.set()


@dataclass(frozen=True)
class _Opened:
    """A server's session (an `mcp.client.Client`) and the tools it listed."""

    client: Any
    tools: list[Any]


async def _open(server: McpServer, stack: contextlib.AsyncExitStack) -> _Opened:
    """Start or reach `server`, shake hands and list its tools; `stack` closes it later.

    Raises:
        McpServerError: The server failed to start, answer or list its tools.
    """
    from mcp.client import Client

    stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
    errlog = cast(TextIO, stack.enter_context(stderr))  # quoted if the server fails to start
    try:
        client = await stack.enter_async_context(Client(_transport(server, errlog)))
        page = await client.list_tools()
        listed = list(page.tools)
        while page.next_cursor is not None:
            page = await client.list_tools(cursor=page.next_cursor)
            listed += page.tools
    except Exception as error:
        raise McpServerError(_start_failure(server, error, errlog)) from error
    return _Opened(client, listed)


def _transport(server: McpServer, errlog: TextIO) -> Any:
    """What `mcp.client.Client` connects through: the URL, or the stdio subprocess's pipes."""
    if server.url is not None:
        return server.url
    from mcp.client.stdio import StdioServerParameters, stdio_client

    command, *args = server.command
    parameters = StdioServerParameters(command=command, args=args, env=dict(server.env) or None)
    return stdio_client(parameters, errlog=errlog)


def _start_failure(server: McpServer, error: BaseException, errlog: TextIO) -> str:
    """Why a server did not start: its error, and the end of what it wrote to stderr."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    message = f"MCP server {str(server)!r} ({OPTION}) did not start or answer: {error!r}"
    errlog.flush()
    errlog.seek(0)
    stderr = errlog.read()[-_STDERR_TAIL_CHARS:].strip()
    if stderr:
        message += f"\nits stderr ended with:\n{stderr}"
    return message


def _as_tool(listed: Any, client: Any, portal: BlockingPortal) -> Tool:
    """One of a server's tools (an `mcp.types.Tool`), called through `client` on `portal`."""
    name = listed.name
    parameters = listed.input_schema or {"type": "object", "properties": {}}
    description = listed.description or listed.title or name
    schema = {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }

    async def call(**arguments: Any) -> str:
        future = portal.start_task_soon(client.call_tool, name, arguments)
        try:
            result = await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)
        except Exception as error:
            if getattr(error, "code", None) == _CONNECTION_CLOSED:  # the mcp package's MCPError
                raise InfrastructureError(f"MCP tool {name}(): the server is gone") from error
            raise
        finally:
            future.cancel()  # a call the caller gave up on (a timeout) stops on the server too
        text = _result_text(result)
        if result.is_error:
            raise McpToolError(text)
        return text

    call.__name__ = call.__qualname__ = name
    return Tool(name=name, schema=schema, fn=call)


def _result_text(result: Any) -> str:
    """A `CallToolResult` as the tool message: its text blocks, one a line.

    A result with no text gives its structured content as JSON; other blocks (images, audio,
    links) are named, not shown.
    """
    lines = []
    for block in result.content:
        text = getattr(block, "text", None)
        if text is None:
            text = getattr(getattr(block, "resource", None), "text", None)
        lines.append(text if isinstance(text, str) else f"[{block.type} content not shown]")
    if not lines and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(lines)
