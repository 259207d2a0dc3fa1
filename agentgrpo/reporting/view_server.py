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
"""

from __future__ import annotations

import ipaddress
import json
import re
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agentgrpo.reporting.view import RunView

_STEP_PATH = re.compile(r"/api/step/(\d+)")
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

    return ThreadingHTTPServer((host, port), Handler)


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

    def do_GET(self) -> None:
        """Answer one of the routes in the module docstring."""
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
