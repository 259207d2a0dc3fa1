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
- Every server is opened once, when `McpTools` is made, and shared by all episodes and every
  round until `close()`: the tools' schemas are what the chat template shows, so they are read
  before any episode plays. Calls from different episodes run concurrently, as the server
  allows. The sessions live on an event loop of their own, in a daemon thread, so that calls
  from any event loop (each round's `anyio.run`, the asynchronous producer's thread) reach them.
- A tool is `{"type": "function", "function": {"name", "description", "parameters"}}` with the
  server's input schema as `parameters`; `tools.call_tool` checks the model's arguments against
  it before the call reaches the server. The result's text blocks, one a line, are the tool
  message (structured content as JSON when there is no text). A result the server marks as an
  error raises `McpToolError` with the server's text, which `call_tool` turns into an error
  message the model reads. A call that times out is cancelled on the server's session too. A
  call whose server is gone (its connection closed) raises `InfrastructureError`: the episode
  is replayed, not shown the error (`tools.infrastructure`).
- `close()` stops every stdio server (stdin closed, then SIGTERM, then SIGKILL, as the `mcp`
  package does) and ends HTTP sessions. It is idempotent, and also runs when the `McpTools` is
  garbage collected and at interpreter exit, so a server never outlives the process that
  started it, whether the run ended, failed or was interrupted. A server that cannot start,
  answer or list its tools within `timeout_s` raises `McpServerError` naming it; every server
  already started is stopped first.

The `mcp` package is imported only when a server is opened: `import tools` stays fast.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import queue
import shlex
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO, cast

import anyio
from anyio.from_thread import BlockingPortal

from tools.infrastructure import InfrastructureError
from tools.schema import Tool

OPTION = "mcp_servers"
"""The option that lists MCP servers (`GRPOConfig.mcp_servers`; `--mcp-server` on the CLI)."""
_SPEC_KEYS = ("command", "args", "env", "url")
_STDERR_TAIL_CHARS = 2000  # how much of a server's stderr a start-up failure quotes
_CONNECTION_CLOSED = -32000  # the MCP error code of a session whose server is gone
_STOP_WAIT_S = 15.0  # longer than the mcp package's stdin, SIGTERM and SIGKILL waits together


class McpServerError(RuntimeError):
    """An MCP server could not be started, reached, or asked for its tools (the user's to fix)."""


class McpToolError(Exception):
    """An MCP server answered a tool call with an error; the message is the server's text."""


@dataclass(frozen=True)
class McpServer:
    """Where an MCP server is: a command that serves MCP on its stdin and stdout, or a URL.

    Attributes:
        command: The executable and its arguments (stdio); empty for an HTTP server.
        url: The streamable HTTP endpoint (`http://127.0.0.1:8000/mcp`), or None for stdio.
        env: Environment variables the stdio server gets beyond the inherited safe ones.
    """

    command: tuple[str, ...] = ()
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        """The server as the user wrote it: its command line, or its URL."""
        return self.url if self.url is not None else shlex.join(self.command)

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any], where: str = OPTION) -> McpServer:
        """The server a spec names: `"cmd args"`, a URL, or a dict (or its JSON text).

        A dict has `command` (text) with optional `args` (a list of texts) and `env` (texts by
        name), or `url` alone.

        Args:
            spec: The spec.
            where: The option it came from, for the error message (`mcp_servers[0]`).

        Raises:
            ValueError: A spec that names no server, or a dict with other keys or types.

        Examples:
            >>> McpServer.parse("python server.py --verbose").command
            ('python', 'server.py', '--verbose')
            >>> McpServer.parse({"url": "http://127.0.0.1:8000/mcp"}).url
            'http://127.0.0.1:8000/mcp'
            >>> McpServer.parse({"url": "ftp://example.com"})
            Traceback (most recent call last):
            ...
            ValueError: mcp_servers: 'url' must be an http(s):// URL, alone; got 'ftp://example.com'
        """
        if isinstance(spec, str):
            return cls._parse_text(spec, where)
        if isinstance(spec, Mapping):
            return cls._parse_mapping(spec, where)
        raise ValueError(
            f"{where}: {spec!r} is a {type(spec).__name__}; give a command (text), an http(s):// "
            "URL, or a dict with 'command' (and 'args', 'env') or 'url'"
        )

    @classmethod
    def _parse_text(cls, text: str, where: str) -> McpServer:
        if text.strip().startswith("{"):  # a dict, as JSON (a command line or config file)
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: {text!r} is not a JSON object ({error})") from None
            return cls._parse_mapping(spec, where)
        if _is_url(text.strip()):
            return cls(url=text.strip())
        try:
            command = tuple(shlex.split(text))
        except ValueError as error:
            raise ValueError(f"{where}: cannot split {text!r} into words ({error})") from None
        if not command:
            raise ValueError(
                f"{where}: {text!r} names no MCP server; give a command that serves MCP on stdio "
                '("python server.py"), or an http(s):// URL'
            )
        return cls(command=command)

    @classmethod
    def _parse_mapping(cls, spec: Mapping[str, Any], where: str) -> McpServer:
        if unknown := sorted(set(map(str, spec)) - set(_SPEC_KEYS)):
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r}; an MCP server is given by 'command' "
                "(with 'args' and 'env') or by 'url'"
            )
        if ("command" in spec) == ("url" in spec):
            raise ValueError(f"{where}: give exactly one of 'command' and 'url', in {dict(spec)}")
        if "url" in spec:
            url = spec["url"]
            if set(spec) != {"url"} or not isinstance(url, str) or not _is_url(url):
                raise ValueError(f"{where}: 'url' must be an http(s):// URL, alone; got {url!r}")
            return cls(url=url)
        command, args, env = spec["command"], spec.get("args", []), spec.get("env", {})
        if not isinstance(command, str) or not command.strip():
            raise ValueError(f"{where}: 'command' must be the executable's name, got {command!r}")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}: 'args' must be a list of texts, got {args!r}")
        texts = isinstance(env, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        )
        if not texts:
            raise ValueError(f"{where}: 'env' must map names to texts, got {env!r}")
        return cls(command=(command, *args), env=tuple(sorted(env.items())))

    def check(self, where: str = OPTION) -> None:
        """Refuse a stdio server whose executable is not there (before anything starts).

        Raises:
            ValueError: The command is neither a file nor found on PATH.
        """
        if self.command and shutil.which(self.command[0]) is None:
            raise ValueError(
                f"{where}: cannot start MCP server {str(self)!r}: {self.command[0]!r} is not "
                "an executable file or a command on PATH"
            )


def mcp_servers_of(
    specs: Sequence[str | Mapping[str, Any]] | None, option: str = OPTION
) -> tuple[McpServer, ...]:
    """Every spec of `option` parsed (`McpServer.parse`) and checked (`McpServer.check`).

    Raises:
        ValueError: Naming the option, the spec's index and what to write instead.
    """
    if specs is None:
        return ()
    if isinstance(specs, str | Mapping):
        raise ValueError(f"{option} is a list of MCP servers; wrap the one given in [...]")
    servers: list[McpServer] = []
    for index, spec in enumerate(specs):
        server = McpServer.parse(spec, f"{option}[{index}]")
        server.check(f"{option}[{index}]")
        servers.append(server)
    if servers:
        _require_mcp(option)
    return tuple(servers)


def _require_mcp(option: str) -> None:
    """Refuse MCP servers where the `mcp` package (the protocol's client) is not installed."""
    if importlib.util.find_spec("mcp") is None:
        raise ValueError(
            f"{option}: MCP servers need the mcp package; install it with "
            "pip install 'agentgrpo[mcp]'"
        )


def _is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


class McpTools:
    """MCP servers held open, their tools offered as `Tool`s, until `close()`.

    Args:
        servers: The servers, in order; their tool names must all differ.
        timeout_s: Seconds all of them together may take to start and list their tools;
            None for no limit.

    Attributes:
        tools: Every server's tools by name, in the servers' order.

    Raises:
        McpServerError: A server did not start, answer or list its tools in time.
        ValueError: Two servers offer a tool of one name (the model could call only one), or
            the `mcp` package is not installed.
    """

    def __init__(self, servers: Sequence[McpServer], timeout_s: float | None = 60.0):
        _require_mcp(OPTION)
        self._loop = _ServerLoop(tuple(servers), timeout_s)
        weakref.finalize(self, self._loop.stop)
        self.tools: dict[str, Tool] = self._loop.tools

    def close(self) -> None:
        """Stop the stdio servers and end the HTTP sessions; a second call does nothing."""
        self._loop.stop()

    def __enter__(self) -> McpTools:
        """Use as `with McpTools(servers) as mcp: ...`: closed on the way out."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close on the way out, whatever happened."""
        self.close()


class _ServerLoop:
    """An anyio event loop in a daemon thread that holds the sessions open until `stop()`."""

    def __init__(self, servers: tuple[McpServer, ...], timeout_s: float | None):
        self._servers, self._timeout_s = servers, timeout_s
        self._started: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._stopping = threading.Lock()
        self._portal: BlockingPortal | None = None
        self._close_sessions: anyio.Event | None = None
        self.tools: dict[str, Tool] = {}
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
                raise ValueError(
                    f"two MCP servers ({OPTION}) offer a tool named {listed.name!r}, the second "
                    f"{str(server)!r}; the model could call only one: drop one of the servers"
                )
            self.tools[listed.name] = _as_tool(listed, opened.client, portal)

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
