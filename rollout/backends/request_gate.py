"""Requests to a generation server, and the weight pushes that must find none of them in flight.

Requests run in worker threads (`VLLMServerBackend`); a push runs in another. `RequestGate`
counts the requests in flight and tags each with the weights version current when it was sent.
A push holds new requests back, has the ones in flight cut short (the server returns what they
had sampled), and runs once none is left: every token of a request is drawn with the version it
was tagged with.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

# How often a push asks the server again to cut short requests that are still in flight.
ABORT_EVERY_S = 0.5


class RequestGate:
    """The requests in flight to one server, and the version of the weights serving them.

    `version`: tags the tokens of requests sent from now on (None: no tags).
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self._changed = threading.Condition()  # guards the fields below
        self._in_flight = 0
        self._held = False

    @contextlib.contextmanager
    def request(self) -> Iterator[int | None]:
        """One request, sent once no push holds requests back; yields its weights version."""
        with self._changed:
            self._changed.wait_for(lambda: not self._held)
            self._in_flight += 1
            version = self.version
        try:
            yield version
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold new requests back until the block ends (one holder at a time)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._held)
            self._held = True
        try:
            yield
        finally:
            with self._changed:
                self._held = False
                self._changed.notify_all()

    def wait_until_idle(self, abort: Callable[[], None], timeout_s: float) -> None:
        """Call `abort` until no request is in flight (inside `holding`).

        `abort` asks the server to cut short what it runs; it is called again every
        `ABORT_EVERY_S` for requests that reached the server after the previous call.

        Raises:
            TimeoutError: Requests still in flight after `timeout_s` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._changed:
                if self._changed.wait_for(lambda: self._in_flight == 0, ABORT_EVERY_S):
                    return
                in_flight = self._in_flight
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{in_flight} request(s) were still in flight {timeout_s:g} s after the "
                    "server was asked to cut them short for a weight push"
                )
            abort()
