"""Sessions with OpenEnv environments: an instance in this process, or a server's WebSocket session.

`LocalSession` plays an ``openenv.core.Environment`` instance directly: an action is validated
by its ``Action`` model (a refusal is the model's mistake: a `ValueError` it reads), then
stepped. `RemoteSession` plays one session of an OpenEnv server through OpenEnv's own client
(``GenericEnvClient``, over the server's ``/ws`` WebSocket, where each connection has an
environment of its own); the action is checked against the server's action schema first, with
``jsonschema``, so the model reads what is wrong rather than the server's bare "Invalid
message". A server that cannot be reached, or does not answer within the timeout, during an
episode is an `InfrastructureError` (the episode is replayed, never scored); one that is full
(its ``max_concurrent_envs`` reached) is the user's to fix, loudly.

Importing ``openenv.core`` needs fastmcp; openenv-core 0.3.0 takes any fastmcp from 3.0, and
fastmcp 4.1.1 is the newest whose MCP client accepts the mcp 2.0.0 that verifiers pins (the
``openenv`` package, 0.10.0, caps fastmcp below 4, which needs mcp below 2). ``make install``
installs openenv-core without its dependencies (gradio, only for OpenEnv's web interface, is
left out) and fastmcp 4.1.1 beside mcp 2.0.0.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import io
import json
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from websockets.exceptions import WebSocketException

from environments.errors import EnvironmentSpecError
from environments.observations import observation_text
from tools.infrastructure import InfrastructureError
from tools.threads import describe_error

DEFAULT_TIMEOUT_S = 60.0
"""How long a remote environment may take to answer one request, unless ``timeout=`` says."""

_MCP_ACTIONS = frozenset({"Action", "CallToolAction", "ListToolsAction"})
_SPEC_OPTIONS = ("timeout",)
_HIDDEN = frozenset({"done", "reward", "metadata"})  # an Observation's own fields
_USERS_ERRORS = {  # what the server's refusal of a session asks of the user
    "CAPACITY_REACHED": "start it with a larger max_concurrent_envs (create_app(..., "
    "max_concurrent_envs=N), for an environment with SUPPORTS_CONCURRENT_SESSIONS = True) or "
    "run fewer episodes at once",
    "FACTORY_ERROR": "its environment could not be made; the server's log says why",
}
_LARGEST = 100 * 2**20  # bytes in one message, as OpenEnv's own client allows


OPENENV_PREFIX = "openenv:"
INSTALL = "pip install 'agentgrpo[openenv]'"


@dataclass(frozen=True)
class Step:
    """One observation, as the model reads it.

    Attributes:
        shown: The text, or the text and then the images (a list, as tools may return).
        reward: The step's reward (None: the environment gave none, counted as 0).
        done: Whether the episode ended.

    """

    shown: str | list[Any]
    reward: float | None
    done: bool


class Session(Protocol):
    """One episode's connection to an OpenEnv environment, in this process or on a server."""

    def reset(self, seed: int | None, row: Mapping[str, Any]) -> Step:
        """Start an episode; `row` holds the dataset row's columns (``prompt`` left out)."""
        ...

    def step(self, action: dict[str, Any]) -> Step:
        """Take the action the model gave (``act``'s arguments)."""
        ...

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Step:
        """Call an MCP tool of the environment."""
        ...

    def list_tools(self) -> list[dict[str, Any]]:
        """The MCP tools, each ``{"name", "description", "input_schema"}``."""
        ...

    def close(self) -> None:
        """End the episode and release what it holds."""
        ...


@dataclass(frozen=True)
class OpenEnvSpec:
    """What an `OpenEnvEnvironment` class needs: how to open a session, and a label for errors."""

    open: Callable[[], Session]
    label: str


def import_openenv(label: str) -> Any:
    """``openenv.core``; a missing or clashing package says how to install it.

    Raises:
        EnvironmentSpecError: openenv-core (or the fastmcp it imports) does not import.

    """
    try:
        import openenv.core as core
    except ImportError as error:
        raise EnvironmentSpecError(
            f"{label} needs OpenEnv (openenv-core 0.3.0, with fastmcp 4.1.1), which does not "
            f"import here ({describe_error(error)}); install it: {INSTALL}"
        ) from error
    return core


def action_class(cls: type, label: str) -> Any:
    """The ``Action`` model an OpenEnv ``Environment`` class steps with.

    Read from its generic base (``Environment[MyAction, MyObservation, MyState]``), else from
    the hint of ``step``'s ``action``.

    Raises:
        EnvironmentSpecError: Neither names an ``Action`` subclass.

    """
    core = import_openenv(label)
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            arguments = typing.get_args(base)
            if arguments and _is_action(arguments[0], core):
                return arguments[0]
    try:
        hint = typing.get_type_hints(getattr(cls, "step")).get("action")  # noqa: B009
    except Exception:
        hint = None
    if _is_action(hint, core):
        return hint
    raise EnvironmentSpecError(
        f"{label}: cannot tell which Action model {cls.__qualname__} steps with; declare it "
        f"as `class {cls.__name__}(Environment[MyAction, MyObservation, MyState])` or type "
        "`def step(self, action: MyAction, ...)`"
    )


class LocalSession:
    """An OpenEnv ``Environment`` instance in this process, for one episode."""

    def __init__(self, make: Callable[[], Any], action: Any, label: str) -> None:
        self.env = make()
        self.action = action
        self.label = label

    def reset(self, seed: int | None, row: Mapping[str, Any]) -> Step:
        """``env.reset`` with the seed and the row's columns its signature takes."""
        given = {"seed": seed, **row}
        observation = self.env.reset(**_accepted(self.env.reset, given))
        return _observation(observation)

    def step(self, action: dict[str, Any]) -> Step:
        """Validate `action` with the ``Action`` model, then step.

        Raises:
            ValueError: The model refused the action (the model's mistake); says why.

        """
        from pydantic import ValidationError

        try:
            validated = self.action.model_validate(action)
        except ValidationError as error:
            raise ValueError(_refusal(error.errors())) from None
        return _observation(self.env.step(validated))

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Step:
        """Step with OpenEnv's ``CallToolAction``; the tool's error is the model's to read."""
        from openenv.core.env_server.mcp_types import CallToolAction

        observation = self.env.step(CallToolAction(tool_name=name, arguments=arguments))
        fields = {name: getattr(observation, name) for name in type(observation).model_fields}
        return tool_result_step(fields, observation.reward, observation.done)

    def list_tools(self) -> list[dict[str, Any]]:
        """Step with OpenEnv's ``ListToolsAction``: the MCP server's tools."""
        from openenv.core.env_server.mcp_types import ListToolsAction

        with warnings.catch_warnings():  # openenv-core 0.3.0 reads fastmcp 3's field name
            warnings.filterwarnings("ignore", "Accessing `Tool.inputSchema` is deprecated")
            listed = self.env.step(ListToolsAction())
        if listed.metadata.get("error"):
            raise EnvironmentSpecError(
                f"{self.label}: listing its MCP tools failed: {listed.metadata['error']}"
            )
        return [tool.model_dump() for tool in listed.tools]

    def close(self) -> None:
        """``env.close()``."""
        self.env.close()


def remote_spec(url: str, options: dict[str, Any]) -> tuple[OpenEnvSpec, dict[str, Any] | None]:
    """How to play the environment an OpenEnv server serves, and its action schema.

    Args:
        url: The server's address, ``http://host:port``.
        options: ``timeout`` (seconds per request, `DEFAULT_TIMEOUT_S` by default).

    Returns:
        The spec, and the action's JSON schema (None for an MCP environment, whose action is
        OpenEnv's own ``CallToolAction``).

    Raises:
        EnvironmentSpecError: An unknown option, a bad timeout, or no OpenEnv server answering
            ``GET /schema`` at `url` within the timeout.

    """
    label = f"{OPENENV_PREFIX}{url}"
    unknown = sorted(set(options) - set(_SPEC_OPTIONS))
    if unknown:
        raise EnvironmentSpecError(
            f"{label}: unknown option(s) {', '.join(unknown)}; a server takes only timeout=SECONDS"
        )
    timeout_s = options.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise EnvironmentSpecError(
            f"{label}: timeout={timeout_s!r} must be a number of seconds > 0"
        )
    import_openenv(label)
    base = url.rstrip("/")
    action = _schema(base, float(timeout_s), label)
    mcp = action.get("title") in _MCP_ACTIONS
    spec = OpenEnvSpec(lambda: RemoteSession(base, float(timeout_s), action, label), label)
    return spec, None if mcp else action


class RemoteSession:
    """One WebSocket session of an OpenEnv server: its ``/ws`` endpoint, OpenEnv's messages.

    Each connection has an environment of its own on the server; a message is
    ``{"type": "reset" | "step" | "close", "data": ...}`` and its answer
    ``{"type": "observation", "data": {"observation", "reward", "done"}}`` or
    ``{"type": "error", "data": {"message", "code"}}``.
    """

    def __init__(self, url: str, timeout_s: float, action: dict[str, Any], label: str) -> None:
        self.url, self.label, self.action, self.timeout_s = url, label, action, timeout_s
        self.socket: Any = None

    def reset(self, seed: int | None, row: Mapping[str, Any]) -> Step:
        """Open the session and reset its environment (the server passes on what it takes)."""
        from websockets.sync.client import connect

        ws_url = "ws" + self.url.removeprefix("http") + "/ws"
        if self.socket is None:
            self.socket = self._send(
                "connect", lambda: connect(ws_url, open_timeout=self.timeout_s, max_size=_LARGEST)
            )
        data = self._exchange("reset", {"seed": seed, **row})
        return observation_step(data.get("observation", {}), data.get("reward"), data.get("done"))

    def step(self, action: dict[str, Any]) -> Step:
        """Check `action` against the server's schema, then step.

        Raises:
            ValueError: The action does not fit the schema (the model's mistake); says why.

        """
        import jsonschema

        problems = jsonschema.Draft202012Validator(self.action).iter_errors(action)
        errors = [{"loc": list(p.absolute_path), "msg": p.message} for p in problems]
        if errors:
            raise ValueError(_refusal(errors))
        data = self._exchange("step", action)
        return observation_step(data.get("observation", {}), data.get("reward"), data.get("done"))

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Step:
        """Step with a ``call_tool`` action; the tool's error is the model's to read."""
        action = {"type": "call_tool", "tool_name": name, "arguments": arguments}
        data = self._exchange("step", action)
        return tool_result_step(data.get("observation", {}), data.get("reward"), data.get("done"))

    def list_tools(self) -> list[dict[str, Any]]:
        """Step with a ``list_tools`` action: the MCP server's tools (after `reset`)."""
        data = self._exchange("step", {"type": "list_tools"})
        return list(data.get("observation", {}).get("tools", []))

    def close(self) -> None:
        """Say goodbye and close the WebSocket (the server closes the session's environment)."""
        socket, self.socket = self.socket, None
        if socket is None:
            return
        try:
            with contextlib.suppress(WebSocketException):  # closed by the server first
                socket.send(json.dumps({"type": "close"}))
        finally:
            socket.close()

    def _exchange(self, kind: str, data: Mapping[str, Any]) -> dict[str, Any]:
        """Send one message and read its answer's ``data``.

        Raises:
            InfrastructureError: The connection failed, or no answer came within the timeout.
            EnvironmentSpecError: The server is full (its ``max_concurrent_envs``) or cannot make
                the environment.
            ValueError: The server refused the action or its environment raised (a message for
                the model, as an in-process environment's exception is).

        """
        if self.socket is None:
            raise RuntimeError(f"{self.label}: reset() opens the session; call it first")
        socket = self.socket
        message = json.dumps({"type": kind, "data": dict(data)})
        with contextlib.suppress(WebSocketException):  # closed at once: its reason waits below
            socket.send(message)
        answer = json.loads(self._send(kind, lambda: socket.recv(timeout=self.timeout_s)))
        if answer.get("type") != "error":
            return dict(answer.get("data") or {})
        error = answer.get("data") or {}
        text = f"{error.get('message')} (code: {error.get('code')})"
        if error.get("code") in _USERS_ERRORS:
            raise EnvironmentSpecError(
                f"{self.label}: the server refused the session: {text}; "
                f"{_USERS_ERRORS[error['code']]}"
            )
        details = "; ".join(
            str(e.get("msg")) for e in error.get("errors", ()) if isinstance(e, dict)
        )
        raise ValueError(f"{text}: {details}" if details else text)

    def _send(self, what: str, request: Callable[[], Any]) -> Any:
        """`request`'s result; a lost connection or a silent server is an `InfrastructureError`."""
        try:
            return request()
        except (TimeoutError, OSError, WebSocketException) as error:
            raise InfrastructureError(
                f"{self.label}: {what} got no answer within {self.timeout_s:g} s "
                f"({describe_error(error)})"
            ) from error


def _schema(base: str, timeout_s: float, label: str) -> dict[str, Any]:
    """The action JSON schema a server gives at ``GET /schema``.

    Raises:
        EnvironmentSpecError: No answer, or not an OpenEnv server's.

    """
    import requests

    session = requests.Session()
    session.trust_env = False  # a loopback server is never behind the environment's proxy
    try:
        response = session.get(f"{base}/schema", timeout=timeout_s)
        response.raise_for_status()
        action = response.json()["action"]
    except Exception as error:
        raise EnvironmentSpecError(
            f"{label}: no OpenEnv server answered GET {base}/schema within {timeout_s:g} s "
            f"({describe_error(error)}); start the server (e.g. `uvicorn my_env.server.app:app "
            "--port 8000`) or check the address; ,timeout=SECONDS waits longer"
        ) from error
    finally:
        session.close()
    if not isinstance(action, dict):
        raise EnvironmentSpecError(f"{label}: GET {base}/schema gave no action schema")
    return action


def _observation(observation: Any) -> Step:
    fields = {name: getattr(observation, name) for name in type(observation).model_fields}
    return observation_step(fields, observation.reward, observation.done)


def _accepted(method: Callable[..., Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `given` that `method` takes by name (all of them with ``**kwargs``)."""
    parameters = inspect.signature(method).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(given)
    names = {p.name for p in parameters}
    return {name: value for name, value in given.items() if name in names}


def _refusal(errors: list[Any]) -> str:
    """Pydantic's (or jsonschema's) errors as one line the model can act on."""
    parts = []
    for error in errors:
        where = ".".join(str(part) for part in error.get("loc", ())) or "the action"
        parts.append(f"{where}: {error.get('msg')}")
    return "the action was refused: " + "; ".join(parts)


def _is_action(hint: Any, core: Any) -> bool:
    return inspect.isclass(hint) and issubclass(hint, core.Action) and hint is not core.Action


def observation_step(fields: Mapping[str, Any], reward: Any, done: Any) -> Step:
    """A `Step` from an observation's fields (``done``, ``reward``, ``metadata`` left out)."""
    shown = {name: value for name, value in fields.items() if name not in _HIDDEN}
    images = [picture for value in shown.values() if (picture := as_picture(value)) is not None]
    texts = {name: _plain(value) for name, value in shown.items() if as_picture(value) is None}
    only = next(iter(texts.values())) if len(texts) == 1 else None
    text = only if isinstance(only, str) else observation_text(texts)
    return Step([text, *images] if images else text, _reward(reward), bool(done))


def tool_result_step(observation: Mapping[str, Any], reward: Any, done: Any) -> Step:
    """A `Step` from an MCP ``CallToolObservation``'s fields (or their JSON).

    Raises:
        ValueError: The call failed (``error`` set, or the result is marked an error); the
            message, for the model, is the error's.

    """
    error, result = observation.get("error"), observation.get("result")
    if error:
        message = error.get("message") if isinstance(error, Mapping) else error.message
        raise ValueError(str(message))
    content = (
        result.get("content") if isinstance(result, Mapping) else getattr(result, "content", None)
    )
    failed = (
        result.get("is_error")
        if isinstance(result, Mapping)
        else getattr(result, "is_error", False)
    )
    texts, images = [], []
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, Mapping) else getattr(part, "type", None)
        get = part.get if isinstance(part, Mapping) else lambda key, p=part: getattr(p, key, None)
        if kind == "text":
            texts.append(str(get("text")))
        elif kind == "image":
            picture = _decoded_picture(get("data"))
            if picture is None:  # said, not dropped silently: the model may ask again
                texts.append("(an image that is not a readable picture was left out)")
            else:
                images.append(picture)
    text = "\n".join(texts) if content is not None else observation_text(_plain(result))
    if failed:
        raise ValueError(text)
    return Step([text, *images] if images else text, _reward(reward), bool(done))


def as_picture(value: Any) -> Any:
    """`value` as a PIL image if it is one (or a ``uint8`` picture array), else None."""
    from tools.call import is_image

    if is_image(value):
        return value
    shape = getattr(value, "shape", None)
    dtype = str(getattr(value, "dtype", ""))
    if shape is None or dtype != "uint8" or len(shape) not in (2, 3):
        return None
    if len(shape) == 3 and shape[2] not in (3, 4):
        return None
    from PIL import Image

    return Image.fromarray(value)


def _plain(value: Any) -> Any:
    """A value `observation_text` can write: models as their fields, enums as their values."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, Enum):
        return value.value
    return value


def _reward(value: Any) -> float | None:
    return None if value is None else float(value)


def _decoded_picture(data: Any) -> Any:
    """An MCP image part's base64 ``data`` as a PIL image; None when it cannot be read."""
    try:
        from PIL import Image

        return Image.open(io.BytesIO(base64.b64decode(str(data))))
    except Exception:
        return None
