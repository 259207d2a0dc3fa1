"""A small real MCP server for the tests of `tools.mcp`, built with the `mcp` package's MCPServer.

`python tests/scripts/mcp_server.py` serves over stdio; `... --http` serves streamable HTTP on
127.0.0.1, on a port the system picks, and prints `port N` once it listens. `--die` exits at
once, before answering anything (a server that cannot start); with `--linger` the server stays
for a minute after its stdin closes, so that only a signal ends it (as some servers behave).

Tools: `add` (two integers), `fail` (always an MCP tool error), `pid` (the server's process id,
so a test can check that the process is gone), `wait` (sleeps, for timeouts) and `remember`
(state kept for as long as the server lives, so a test can tell one shared server from several).
"""

from __future__ import annotations

import os
import socket
import sys
import time

import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("agentgrpo-test")
_notes: list[str] = []


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with the reason given."""
    raise ValueError(f"failed on purpose: {reason}")


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def remember(note: str) -> int:
    """Keep a note; returns how many notes this server holds."""
    _notes.append(note)
    return len(_notes)


@server.tool()
async def wait(seconds: float) -> str:
    """Sleep, then say so."""
    await anyio.sleep(seconds)
    return "woke"


def _serve_http() -> None:
    import uvicorn

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()  # a client may connect as soon as the port is printed
    print(f"port {listening.getsockname()[1]}", flush=True)
    app = server.streamable_http_app()
    config = uvicorn.Config(app, log_level="warning")
    anyio.run(uvicorn.Server(config).serve, [listening])


if __name__ == "__main__":
    if "--die" in sys.argv:
        sys.exit("refusing to start, as asked (--die)")
    if "--http" in sys.argv:
        _serve_http()
    else:
        server.run()
    if "--linger" in sys.argv:
        time.sleep(60)
