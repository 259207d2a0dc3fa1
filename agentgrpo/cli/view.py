"""`agentgrpo view RUN_DIR`: a web page to watch a run's agent, live or as one HTML file.

Served (the default), the page follows a run in progress: it polls the server for new steps
and redraws the charts as `metrics.jsonl` grows. `--html OUT.html` writes the page with every
recorded step in it and exits. The page itself is `agentgrpo.reporting.view`.
"""

from __future__ import annotations

import argparse
import errno
from pathlib import Path
from typing import Any

from agentgrpo.cli.options import UsageError, value_parser

DEFAULT_PORT = 8765
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parser(sub: argparse._SubParsersAction, handler: Any) -> argparse.ArgumentParser:
    """The `view` subcommand's parser, its handler set to `handler`."""
    help_text = "a web page of a run's curves and episodes, token by token"
    parser = sub.add_parser("view", help=help_text, description=help_text, allow_abbrev=False)
    parser.set_defaults(handler=handler)
    parser.usage = "agentgrpo view RUN_DIR [--port N] [--host H] [--html OUT.html]"
    parser.epilog = (
        "Without --html, the page is served until Ctrl-C and follows a run in progress. Token "
        "texts come from the tokenizer the run saved (model/, else its latest checkpoint); "
        "until it has saved one, tokens show their ids."
    )
    add = parser.add_argument
    add("run_dir", metavar="RUN_DIR", help="a run's output folder (`agentgrpo run --output-dir`)")
    add(
        "--port",
        type=value_parser("port", int),
        default=DEFAULT_PORT,
        help=f"port to serve on; 0 picks a free one (default: {DEFAULT_PORT})",
    )
    add(
        "--host",
        default="127.0.0.1",
        help="address to serve on (default: 127.0.0.1, this machine only)",
    )
    add("--html", metavar="OUT.html", help="write the page as one static file and exit")
    add(
        "--tokenizer",
        metavar="FOLDER",
        help="a saved tokenizer to show token texts with (default: the run's own)",
    )
    return parser


def view(namespace: argparse.Namespace) -> int:
    """Write the page (`--html`) or serve it until Ctrl-C; returns the exit status (0)."""
    from agentgrpo.reporting.view import RunView

    if not 0 <= namespace.port <= 65535:
        raise UsageError(f"--port takes 0 to 65535, not {namespace.port}")
    tokenizer = namespace.tokenizer
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise UsageError(f"--tokenizer takes a folder holding a saved tokenizer, not {tokenizer!r}")
    run_view = RunView(namespace.run_dir, tokenizer=tokenizer)
    if namespace.html:
        return _write_page(run_view, Path(namespace.html))
    return _serve(run_view, namespace.host, namespace.port)


def _write_page(run_view: Any, path: Path) -> int:
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--html {path}: the folder {path.parent} does not exist")
    text = run_view.page(live=False)
    path.write_text(text, encoding="utf-8")
    steps = len(run_view.index()["steps"])
    print(f"wrote {path} ({steps} steps, {len(text) / 1e6:.1f} MB); open it in a browser")
    return 0


def _serve(run_view: Any, host: str, port: int) -> int:
    from agentgrpo.reporting.view_server import make_server

    try:
        server = make_server(run_view, host, port)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise UsageError(
                f"port {port} on {host} is in use; pass --port N, or --port 0 for a free one"
            ) from error
        raise UsageError(
            f"cannot serve on {host} port {port}: {error.strerror or error}"
        ) from error
    bound_port = server.server_address[1]
    shown_host = f"[{host}]" if ":" in host else host
    print(f"agentgrpo view: http://{shown_host}:{bound_port}/ (Ctrl-C stops)", flush=True)
    if host not in _LOOPBACK:
        print(f"note: --host {host} shows this run's episodes to anyone who can reach it")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped")
    finally:
        server.server_close()
    return 0
