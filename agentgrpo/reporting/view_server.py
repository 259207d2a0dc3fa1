"""The server behind a live `agentgrpo view` page (the standard library's `http.server`).

Routes, all GET:

- `/`: the page (`RunView.page(live=True)`);
- `/api/index?metrics=KEY`: `RunView.index(KEY)` as JSON, which the page polls;
- `/api/step/N`: `RunView.step(N)` as JSON.

A file the run has not written (a step it did not record) answers 404, a file that does not read
500; both with `{"error": message}`. A line of a step's file that is not an episode record is
skipped and named in the step's `note`, so the rest of the step still shows. A request whose
`Host` header names neither this machine's loopback (`localhost`, `127.0.0.1`, `[::1]`), nor the
host the server is bound to, nor any IP address answers 403: a web page on another site, its
name rebound to this machine (DNS rebinding), cannot read the run. Each request runs in its own
thread; the server logs nothing per request.

Slow or hostile clients cannot take the viewer down: a request line, header or path is at most
64 KiB and 100 headers (the standard library's bounds), a body is never read, a client has
`REQUEST_TIMEOUT_S` to send its whole request (one trickling a byte at a time is cut there) and
to take each answer, and at most `MAX_CONNECTIONS` are served at once (one more is answered 503
at once), so threads, sockets and memory stay bounded and the page's next poll gets in.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import re
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agentgrpo.reporting.view import RunView

REQUEST_TIMEOUT_S = 10.0
"""Seconds a client has to send its whole request, and to take each write of the answer."""
MAX_CONNECTIONS = 32
"""Connections served at once; one more is answered 503 and closed (a page polls again)."""

_STEP_PATH = re.compile(r"/api/step/(\d{1,18})")  # a longer number is no step: 404
_HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]@/\s]+)(?::\d*)?")  # name[:port]


def make_server(view: RunView, host: str, port: int) -> ThreadingHTTPServer:
    """A server for `view`'s page bound to `host:port` (port 0: a free one); not yet serving.

    Raises:
        OSError: The address cannot be bound (the port is in use, the host is not this
            machine's).
    """

    class Handler(_Handler):
        run_view = view
        host_names = frozenset({*_LOOPBACK_NAMES, host.lower().strip("[]")})

    return _BoundedServer((host, port), Handler)


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `MAX_CONNECTIONS` of them; clients that leave are quiet."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve `request` in a thread of its own, or answer 503 when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            _refuse_busy(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve `request`, then free its slot."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Say nothing of a client that went away or was too slow; print anything else."""
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


def _refuse_busy(request: socket.socket) -> None:
    """Answer 503 without waiting on the client (the accept loop runs this)."""
    with contextlib.suppress(OSError):
        request.settimeout(1.0)
        request.sendall(
            b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n\r\n"
        )
        # Read what the request sent so far, not waiting: closing over unread bytes sends a
        # reset, which can reach the client before the answer does.
        request.recv(1 << 16, socket.MSG_DONTWAIT)


class _ReadBefore(io.RawIOBase):
    """A connection's bytes until a deadline: a request that trickles in is cut there."""

    def __init__(self, connection: socket.socket, deadline: float):
        self.connection, self.deadline = connection, deadline

    def readable(self) -> bool:
        """It reads."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Receive into `buffer`, waiting no later than the deadline (`TimeoutError` then)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {REQUEST_TIMEOUT_S:g} s")
        self.connection.settimeout(left)
        return self.connection.recv_into(buffer)


_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_allowed(header: str | None, names: frozenset[str]) -> bool:
    """Whether a `Host` header names one of `names` or an IP address (any port).

    A page can make a browser send only its own site's name, so a name of ours or an address
    (which no site's name is) means the request was not sent on behalf of another site.

    >>> names = frozenset({"localhost", "127.0.0.1", "::1"})
    >>> [host_allowed(h, names) for h in ("localhost:8765", "[::1]:1", "10.0.0.2", "evil.com")]
    [True, True, True, False]
    """
    match = _HOST_HEADER.fullmatch(header or "")
    if match is None:
        return False
    name = match[1].strip("[]").lower()
    if name in names:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Handler(BaseHTTPRequestHandler):
    run_view: RunView
    host_names: frozenset[str]

    def setup(self) -> None:
        """Read the request through a `_ReadBefore` (`handle_one_request` drops it on timeout)."""
        super().setup()
        self.rfile.close()  # the buffered reader over the socket that `setup` made
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        self.rfile = io.BufferedReader(_ReadBefore(self.connection, deadline))

    def do_GET(self) -> None:
        """Answer one of the routes in the module docstring."""
        self.connection.settimeout(REQUEST_TIMEOUT_S)  # for the answer: a client must take it
        host = self.headers.get("Host")
        if not host_allowed(host, self.host_names):
            names = ", ".join(sorted(self.host_names))
            message = f"this viewer answers for {names} or an IP address, not Host {host!r}"
            self._send_json(HTTPStatus.FORBIDDEN, {"error": message})
            return
        url = urlsplit(self.path)
        step = _STEP_PATH.fullmatch(url.path)
        try:
            if url.path == "/":
                self._send(HTTPStatus.OK, "text/html", self.run_view.page(live=True))
            elif url.path == "/api/index":
                known = parse_qs(url.query).get("metrics", [None])[0]
                self._send_json(HTTPStatus.OK, self.run_view.index(known))
            elif step:
                self._send_json(HTTPStatus.OK, self.run_view.step(int(step[1])))
            else:
                self._send_json(HTTPStatus.NOT_FOUND, {"error": f"no page at {url.path}"})
        except FileNotFoundError as error:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": str(error)})
        except (OSError, ValueError) as error:
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(error)})

    def _send_json(self, status: HTTPStatus, value: Any) -> None:
        self._send(status, "application/json", json.dumps(value, allow_nan=False))

    def _send(self, status: HTTPStatus, content_type: str, text: str) -> None:
        body = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", f"{content_type}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: the terminal shows the URL, not every poll."""
