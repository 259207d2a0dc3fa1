"""The door of `agentgrpo vllm-serve`: every request carries the server's key, or stays local.

vLLM's own `--api-key` guards `/v1`, `/inference` and a few other prefixes, but not the
endpoints that `VLLM_SERVER_DEV_MODE=1` opens (`/collective_rpc`, `/pause`, the cache resets),
through which a client joins the weight group and replaces the served weights. `ServerGuard`,
an ASGI middleware that `agentgrpo vllm-serve` hands to vLLM (`--middleware`), guards every
path:

- with `AGENTGRPO_VLLM_KEY` set in the server's environment, a request must carry
  `Authorization: Bearer <key>` (401 otherwise). The trainer sends the key it finds in its own
  environment under the same name (`ServerConnection`);
- without a key the server listens on a loopback address only (`agentgrpo vllm-serve` refuses
  any other `--host`), and a request must name a loopback host in its `Host` header (403
  otherwise), so that a web page open on this machine cannot reach the server through a DNS
  name that resolves to 127.0.0.1.

A request body is bounded too: vLLM reads a body whole into memory before it parses it, so a
body over `MAX_REQUEST_MB` is answered 413 and one without a length (chunked) 411, unread. The
largest request agentgrpo sends, a prompt with pictures each under `tools.MAX_PICTURE_PIXELS`,
is far below it.

Standard library only: it runs inside vLLM's server process.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

KEY_VARIABLE = "AGENTGRPO_VLLM_KEY"
MAX_REQUEST_MB = 256

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def server_key() -> str | None:
    """The key in this process's environment (`AGENTGRPO_VLLM_KEY`), or None when unset or empty."""
    return os.environ.get(KEY_VARIABLE) or None


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine's own.

    >>> [is_loopback(h) for h in ("localhost", "127.0.0.1", "[::1]", "0.0.0.0", "gpu-box")]
    [True, True, True, False, False]
    """
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class ServerGuard:
    """ASGI middleware: refuse every request without the server's key (or, keyless, not local).

    Args:
        app: The application it guards (vLLM's).

    The key is read from the environment once, when vLLM builds its application.
    """

    def __init__(self, app: App) -> None:
        self.app = app
        key = server_key()
        self._key_digest = None if key is None else _digest(key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, or answer it with 401 or 403 without reaching vLLM."""
        if scope["type"] not in ("http", "websocket"):  # lifespan events
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope.get("headers", ())}
        refusal = self._refusal(headers) or _size_refusal(headers)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, reason = refusal
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": reason}).encode()
        start = {"type": "http.response.start", "status": status}
        start["headers"] = [(b"content-type", b"application/json")]
        await send(start)
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        """Why a request with these headers is refused (status, reason), or None."""
        if self._key_digest is not None:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self._key_digest):
                return None
            return 401, f"this server needs its key: send the {KEY_VARIABLE} it was started with"
        host = headers.get(b"host", b"").decode("latin-1")
        if is_loopback(_without_port(host)):
            return None
        return 403, (
            f"this server has no key and answers requests addressed to localhost only, not "
            f"{host!r}: start it with {KEY_VARIABLE} set to reach it by another name"
        )


def _size_refusal(headers: dict[bytes, bytes]) -> tuple[int, str] | None:
    """Why a request's body is refused unread (status, reason), or None when it may be read."""
    length = headers.get(b"content-length")
    if length is None:
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            return 411, "send the body with a Content-Length"
        return None
    if not length.strip().isdigit() or int(length) > MAX_REQUEST_MB << 20:
        return 413, f"a request body may hold at most {MAX_REQUEST_MB} MiB"
    return None


def _digest(key: str) -> bytes:
    """A fixed-length digest, so that comparing keys takes the same time whatever their length."""
    return hashlib.sha256(key.encode()).digest()


def _without_port(host: str) -> str:
    """A `Host` header's name without its port.

    >>> [_without_port(h) for h in ("127.0.0.1:8000", "[::1]:8000", "localhost", "[::1]")]
    ['127.0.0.1', '[::1]', 'localhost', '[::1]']
    """
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
