"""The server behind a live `agentgrpo view` page (the standard library's `http.server`).

Routes, all GET:

- `/`: the page (`RunView.page(live=True)`);
- `/api/index?metrics=KEY`: `RunView.index(KEY)` as JSON, which the page polls;
- `/api/step/N`: `RunView.step(N)` as JSON.

A file the run has not written (a step it did not record) answers 404, a file that does not read
500; both with `{"error": message}`. Each request runs in its own thread; the server logs
nothing per request.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agentgrpo.reporting.view import RunView

_STEP_PATH = re.compile(r"/api/step/(\d+)")


def make_server(view: RunView, host: str, port: int) -> ThreadingHTTPServer:
    """A server for `view`'s page bound to `host:port` (port 0: a free one); not yet serving.

    Raises:
        OSError: The address cannot be bound (the port is in use, the host is not this
            machine's).
    """

    class Handler(_Handler):
        run_view = view

    return ThreadingHTTPServer((host, port), Handler)


class _Handler(BaseHTTPRequestHandler):
    run_view: RunView

    def do_GET(self) -> None:
        """Answer one of the routes in the module docstring."""
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
