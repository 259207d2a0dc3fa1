"""Where MCP servers are: the specs of `mcp_servers` / `--mcp-server`, parsed and checked.

`McpServer.parse` turns one spec (a command line, a URL, or a dict or its JSON text) into an
`McpServer`; `mcp_servers_of` parses and checks a whole `mcp_servers` list, with errors naming
`mcp_servers[i]`. Nothing here starts a server or imports the `mcp` package (`tools.mcp` does).
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPTION = "mcp_servers"
"""The option that lists MCP servers (`GRPOConfig.mcp_servers`; `--mcp-server` on the CLI)."""
_SPEC_KEYS = ("command", "args", "env", "url", "per_episode")


@dataclass(frozen=True)
class McpServer:
    """Where an MCP server is: a command that serves MCP on its stdin and stdout, or a URL.

    Attributes:
        command: The executable and its arguments (stdio); empty for an HTTP server.
        url: The streamable HTTP endpoint (`http://127.0.0.1:8000/mcp`), or None for stdio.
        env: Environment variables the stdio server gets beyond the inherited safe ones.
        per_episode: Whether each episode gets a server of its own (a stdio server started
            for it, an HTTP server a session of its own), stopped when the episode ends; False:
            one server (one session) shared by every episode of the run.
    """

    command: tuple[str, ...] = ()
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    per_episode: bool = False

    def __str__(self) -> str:
        """The server as the user wrote it: its command line, or its URL."""
        return self.url if self.url is not None else shlex.join(self.command)

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any], where: str = OPTION) -> McpServer:
        """The server a spec names: `"cmd args"`, a URL, or a dict (or its JSON text).

        A dict has `command` (text) with optional `args` (a list of texts) and `env` (texts by
        name), or `url`; either may add `per_episode` (true or false, the default).

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
            >>> McpServer.parse('{"command": "python", "args": ["s.py"], "per_episode": true}')
            McpServer(command=('python', 's.py'), url=None, env=(), per_episode=True)
            >>> McpServer.parse({"url": "ftp://example.com"})
            Traceback (most recent call last):
            ...
            ValueError: mcp_servers: 'url' must be an http(s):// URL, with no 'args' or 'env'; got 'ftp://example.com'
        """
        if isinstance(spec, str):
            return cls._parse_text(spec, where)
        if isinstance(spec, Mapping):
            return cls._parse_mapping(spec, where)
        raise ValueError(
            f"{where}: {spec!r} is a {type(spec).__name__}; give a command (text), an http(s):// "
            "URL, or a dict with 'command' (and 'args', 'env') or 'url', and 'per_episode'"
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
                "(with 'args' and 'env') or by 'url', either with 'per_episode'"
            )
        if ("command" in spec) == ("url" in spec):
            raise ValueError(f"{where}: give exactly one of 'command' and 'url', in {dict(spec)}")
        per_episode = spec.get("per_episode", False)
        if not isinstance(per_episode, bool):
            raise ValueError(f"{where}: 'per_episode' must be true or false, got {per_episode!r}")
        if "url" in spec:
            url = spec["url"]
            if set(spec) - {"url", "per_episode"} or not isinstance(url, str) or not _is_url(url):
                raise ValueError(
                    f"{where}: 'url' must be an http(s):// URL, with no 'args' or 'env'; "
                    f"got {url!r}"
                )
            return cls(url=url, per_episode=per_episode)
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
        return cls(
            command=(command, *args), env=tuple(sorted(env.items())), per_episode=per_episode
        )

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
        require_mcp(option)
    return tuple(servers)


def require_mcp(option: str) -> None:
    """Refuse MCP servers where the `mcp` package (the protocol's client) is not installed."""
    if importlib.util.find_spec("mcp") is None:
        raise ValueError(
            f"{option}: MCP servers need the mcp package; install it with "
            "pip install 'agentgrpo[mcp]'"
        )


def _is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))
