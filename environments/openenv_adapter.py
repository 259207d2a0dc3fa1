"""OpenEnv environments: ``openenv:module:Class`` in this process, ``openenv:http://host:port``.

`openenv_environment(spec)` turns the text after ``openenv:`` into an environment class.
OpenEnv (the ``openenv-core`` package, 0.3.0) writes an environment as a subclass of
``openenv.core.Environment`` with ``reset(seed, episode_id, **kwargs)`` and ``step(action)``,
where the action is a pydantic ``Action`` model and each observation a pydantic ``Observation``
with ``done`` and ``reward``. The class built here plays one through tools:

- the tools: for an ``MCPEnvironment``, the tools its MCP server lists, each with the argument
  schema the server gives it; for any other environment, one tool, ``act``, whose arguments are
  the ``Action`` model's fields (``metadata`` left out), typed from the model's JSON schema: an
  enum or a ``Literal`` field takes one of its values, a field with a default may be left out.
  An action the model gets wrong (the model refuses it) and an MCP tool's error come back to the
  model as the tool's error message, and the environment is not stepped;
- observations as text: an observation's fields (``done``, ``reward`` and ``metadata`` left
  out) are a text field alone as it is, else `observation_text`'s ``field: value`` lines; a
  field holding a PIL image, or a picture as a ``uint8`` array of shape (height, width[, 3 or
  4]), is shown as an image after the text. An MCP tool's result is its text content, its images
  shown as images. ``reset``'s observation is the prompt's last part;
- rewards and ``done``: each step's ``reward`` is added up; ``turn_reward()`` is what the turn's
  steps earned (per-turn credit, ``turn_advantage``), ``reward()`` the episode's sum. An
  observation with ``done`` ends the episode, and its text ends ``(episode over)``;
- rows are one prompt per seed (``"train"`` from 0, ``"eval"`` from 1,000,000), as for ``gym:``;
  a row's other columns go to the environment's ``reset`` where it takes them (as OpenEnv's
  server passes a reset request's fields). ``episode_limits`` allows `MAX_TURNS` turns and a
  first observation's length per turn.

``openenv:module:Class`` (or ``openenv:path/to/file.py:Class``) makes one instance per episode;
``key=value`` after it goes to the class's constructor: ``openenv:my_envs:Maze,size=5``.
``openenv:http://host:port`` plays the environment an OpenEnv server serves: each episode opens
a session of its own (the server's ``/ws`` WebSocket), the action schema comes from the server's
``/schema``, and ``timeout=SECONDS`` (default 60) bounds each request. The sessions, in this
process or with a server, are `environments.openenv_sessions`'s; `openenv_class(Class)` builds
the class for an OpenEnv class at hand.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import operator
import re
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar, Literal

from environments.contract import RESERVED_NAMES
from environments.errors import EnvironmentSpecError
from environments.gym_adapter import PromptRows, step_limits
from environments.gym_ids import MAX_TURNS, parse_spec
from environments.loading import load_attribute
from environments.openenv_sessions import (
    OPENENV_PREFIX,
    LocalSession,
    OpenEnvSpec,
    Session,
    Step,
    action_class,
    import_openenv,
    remote_spec,
)
from tools.threads import describe_error

ACT = "act"
_JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "null": type(None),
}
_BOUNDS = {
    "minimum": "at least",
    "exclusiveMinimum": "more than",
    "maximum": "at most",
    "exclusiveMaximum": "less than",
    "minLength": "length at least",
    "maxLength": "length at most",
}
_UNSET: Any = object()  # an argument the model left out: the field's default applies
_CLASSES: dict[tuple[object, str], type[OpenEnvEnvironment]] = {}


class OpenEnvEnvironment:
    """Base of the classes `openenv_environment` builds: one OpenEnv session per episode.

    Attributes:
        steps: The steps taken this episode (tool calls that reached the environment).
        total_reward: The sum of the steps' rewards.

    """

    _openenv: ClassVar[OpenEnvSpec]
    reward_sums_turns: ClassVar[bool] = True  # `reward()` is the sum of the `turn_reward()`s
    done: bool = False
    _session: Session | None = None

    def reset(self, seed: int | None = None, **row: Any) -> str | list[Any]:
        """Open a session, reset it with the group's seed, and return the first observation.

        Args:
            seed: The group's seed; members of a group get the same one.
            **row: The dataset row; its columns other than ``prompt`` go to the environment's
                ``reset`` where it takes them.

        """
        self.close()
        self._session = self._openenv.open()
        self.steps, self.total_reward, self._earned = 0, 0.0, 0.0
        self._stepping = threading.Lock()  # a call abandoned on timeout may still be stepping
        first = self._session.reset(seed, {k: v for k, v in row.items() if k != "prompt"})
        self.done = first.done
        return first.shown

    def reward(self) -> float:
        """The sum of the rewards of the steps taken so far."""
        return self.total_reward

    def turn_reward(self) -> float:
        """What the steps since the last call earned: the turn's reward."""
        earned, self._earned = self._earned, 0.0
        return earned

    def close(self) -> None:
        """Close the session (if one is open); a later `reset` opens a new one."""
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def _take(self, take: Callable[[Session], Step]) -> str | list[Any]:
        """What the tool methods call: one step, its reward and end recorded."""
        session = self._session
        if session is None:
            raise RuntimeError(f"{type(self).__qualname__}: call reset() before acting")
        with self._stepping:
            if self.done:
                raise ValueError("the episode is over; no more actions are accepted")
            step = take(session)
            self.steps += 1
            reward = float(step.reward or 0.0)
            self.total_reward += reward
            self._earned += reward
            self.done = step.done
        return _marked(step.shown, " (episode over)") if step.done else step.shown


def openenv_environment(spec: str) -> type[OpenEnvEnvironment]:
    """The environment class for an OpenEnv environment class or server.

    Args:
        spec: The part after ``openenv:``: ``module:Class`` or ``path/to/file.py:Class``, with
            optional constructor arguments (``,key=value``), or ``http://host:port`` (also
            ``https://``), with an optional ``,timeout=SECONDS``.

    Returns:
        An `OpenEnvEnvironment` subclass with its tools, ``dataset(split)`` and
        ``episode_limits``; the same class for the same spec.

    Raises:
        EnvironmentSpecError: openenv-core is not installed, the spec names nothing usable
            (not an OpenEnv ``Environment``, no server answering), or the environment fails
            to start or lists unusable tools.

    """
    where, kwargs = parse_spec(spec, OPENENV_PREFIX, "my_package.envs:MyEnvironment")
    key = (where, repr(sorted(kwargs.items())))
    if key not in _CLASSES:
        if where.startswith(("http://", "https://")):
            _CLASSES[key] = build_class(remote_spec(where, kwargs), where)
        else:
            _CLASSES[key] = build_class(_local_spec(where, kwargs), where)
    return _CLASSES[key]


def build_class(found: tuple[OpenEnvSpec, dict[str, Any] | None], where: str) -> type:
    """The environment class for a spec and its action schema (None: an MCP environment).

    A probe session lists the MCP tools and reads the first observation (for the limits).

    Raises:
        EnvironmentSpecError: A tool cannot be made from what the environment declares.

    """
    spec, action_schema = found
    listed, first = _probe(spec, mcp=action_schema is None)
    served = where.startswith(("http://", "https://"))
    last = where.split("//", 1)[-1] if served else where.rsplit(":", 1)[-1]
    name = ("OpenEnvServer_" if served else "OpenEnv") + re.sub(r"\W", "_", last)
    if action_schema is not None:
        doc = (
            f"Take one step in the OpenEnv environment {where}; returns the next observation. "
            f"{action_schema.get('description', '')}"
        )
        act = tool_method(name, ACT, doc, action_schema, _act, spec.label, skip=("metadata",))
        tools = {ACT: act}
        how = f"with the {ACT} tool: each call takes one step and returns the next observation"
    else:
        tools = {tool["name"]: _mcp_method(name, tool, spec.label) for tool in listed}
        how = f"with its tools ({', '.join(tools) or 'none listed'})"
    frame = first.shown if isinstance(first.shown, str) else str(first.shown[0])
    namespace = {
        "__doc__": f"The OpenEnv environment {where}, played {how}; reward: the step rewards' sum.",
        "__module__": __name__,
        "_openenv": spec,
        "prompt": f"Act in the OpenEnv environment {where} {how}. The first observation follows.",
        "episode_limits": step_limits(MAX_TURNS, frame),
        **tools,
    }
    return type(name, (OpenEnvEnvironment, PromptRows), namespace)


def _probe(spec: OpenEnvSpec, mcp: bool) -> tuple[list[dict[str, Any]], Step]:
    """One session's MCP tools (for an MCP environment) and first observation.

    Raises:
        EnvironmentSpecError: Making, listing or resetting the environment failed.

    """
    try:
        probe = spec.open()
        try:
            first = probe.reset(0, {})  # a served MCP environment lists its tools in a session
            return (probe.list_tools() if mcp else []), first
        finally:
            probe.close()
    except EnvironmentSpecError:
        raise
    except Exception as error:
        raise EnvironmentSpecError(
            f"{spec.label}: starting the environment failed: {describe_error(error)}"
        ) from error


def tool_method(
    class_name: str,
    tool: str,
    doc: str,
    schema: Mapping[str, Any],
    call: Callable[[OpenEnvEnvironment, str, dict[str, Any]], str | list[Any]],
    label: str,
    skip: Collection[str] = (),
) -> Callable[..., Any]:
    """A tool method whose keyword arguments are the properties of a JSON `schema`.

    Its signature, annotations and docstring are what `tools.as_tool` reads: each property a
    parameter typed from its schema (`json_hint`), those not required defaulting to "left out"
    (the field's own default applies), those in `skip` left out of the tool. The method calls
    ``call(env, tool, arguments)`` with the arguments given.

    Raises:
        EnvironmentSpecError: The tool's or a property's name cannot be a Python argument.

    """
    _check_name(tool, label)
    definitions = schema.get("$defs", {})
    required = set(schema.get("required", ()))
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    lines = []
    for field, field_schema in schema.get("properties", {}).items():
        if field in skip:
            continue
        if not field.isidentifier() or keyword.iskeyword(field) or field == "self":
            raise EnvironmentSpecError(
                f"{label}: {tool}'s argument {field!r} is not a Python identifier, so it "
                "cannot be a tool argument; rename the field"
            )
        annotations[field] = json_hint(field_schema, definitions)
        default = inspect.Parameter.empty if field in required else _UNSET
        parameters.append(
            inspect.Parameter(
                field,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=annotations[field],
            )
        )
        lines.append(f"    {field}: {_field_words(field, field_schema, definitions)}")
    signature = inspect.Signature(parameters, return_annotation=str)

    def method(*args: Any, **kwargs: Any) -> str | list[Any]:
        bound = signature.bind(*args, **kwargs)
        env = bound.arguments.pop("self")
        given = {name: value for name, value in bound.arguments.items() if value is not _UNSET}
        return call(env, tool, given)

    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__annotations__ = {**annotations, "return": str}
    method.__name__ = tool
    method.__qualname__ = f"{class_name}.{tool}"
    args = "\n\nArgs:\n" + "\n".join(lines) + "\n" if lines else ""
    method.__doc__ = f"{' '.join(doc.split()) or f'Call {tool}.'}{args}"
    return method


def _field_words(field: str, schema: Mapping[str, Any], definitions: Mapping[str, Any]) -> str:
    """A field's description on one line, with its bounds and default, e.g. ``How far (1 to 2)``."""
    referred = definitions.get(str(schema.get("$ref", "")).rsplit("/", 1)[-1], {})
    words = schema.get("description") or referred.get("description") or f"The {field}."
    notes = [f"{name} {schema[key]}" for key, name in _BOUNDS.items() if key in schema]
    if "default" in schema:
        notes.append(f"default {schema['default']!r}")
    text = " ".join(str(words).split())
    return f"{text} ({', '.join(notes)})" if notes else text


def json_hint(schema: Mapping[str, Any], definitions: Mapping[str, Any]) -> Any:
    """The Python type hint `tools.as_tool` turns back into (about) this JSON schema.

    Enums and constants become ``Literal``; ``anyOf``/``oneOf`` a union; arrays ``list[...]``;
    objects ``dict[str, ...]``; a schema without a type ``Any``.

    Examples:
        >>> json_hint({"anyOf": [{"type": "integer"}, {"type": "null"}]}, {})
        int | None
        >>> json_hint({"$ref": "#/$defs/Move"}, {"Move": {"enum": ["up", "down"]}})
        typing.Literal['up', 'down']

    """
    if "$ref" in schema:
        return json_hint(definitions.get(str(schema["$ref"]).rsplit("/", 1)[-1], {}), definitions)
    if "enum" in schema:
        return Literal[tuple(schema["enum"])]
    if "const" in schema:
        return Literal[schema["const"]]
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return _union([json_hint(option, definitions) for option in options])
    kind = schema.get("type")
    if isinstance(kind, list):
        return _union([json_hint({**schema, "type": one}, definitions) for one in kind])
    if kind == "array":
        items = schema.get("items")
        inner = json_hint(items, definitions) if isinstance(items, Mapping) else Any
        return list[inner]  # type: ignore[valid-type]
    if kind == "object":
        values = schema.get("additionalProperties")
        value = json_hint(values, definitions) if isinstance(values, Mapping) else Any
        return dict[str, value]  # type: ignore[valid-type]
    return _JSON_TYPES.get(str(kind), Any)


def _act(env: OpenEnvEnvironment, tool: str, arguments: dict[str, Any]) -> str | list[Any]:
    return env._take(lambda session: session.step(arguments))


def _mcp_method(class_name: str, listed: Mapping[str, Any], label: str) -> Callable[..., Any]:
    name = str(listed.get("name"))
    schema = listed.get("input_schema") or {}

    def call(env: OpenEnvEnvironment, tool: str, arguments: dict[str, Any]) -> str | list[Any]:
        return env._take(lambda session: session.call_tool(tool, arguments))

    return tool_method(class_name, name, str(listed.get("description") or ""), schema, call, label)


def _check_name(tool: str, label: str) -> None:
    """Refuse a tool name that cannot be a method, or that the contract or the base holds."""
    if not tool.isidentifier() or keyword.iskeyword(tool) or tool.startswith("_"):
        raise EnvironmentSpecError(
            f"{label}: tool {tool!r} is not a public Python identifier, so it cannot be a "
            "tool method; rename it in the environment"
        )
    if tool in RESERVED_NAMES or hasattr(OpenEnvEnvironment, tool) or hasattr(PromptRows, tool):
        raise EnvironmentSpecError(
            f"{label}: tool {tool!r} clashes with a name agentgrpo's environment contract "
            f"gives a meaning ({', '.join(sorted(RESERVED_NAMES))}, steps, total_reward); "
            "rename the tool in the environment"
        )


def openenv_class(cls: type, **kwargs: Any) -> type[OpenEnvEnvironment]:
    """The environment class for an OpenEnv ``Environment`` class at hand, as `openenv:` builds it.

    Args:
        cls: A subclass of ``openenv.core.Environment`` (an ``MCPEnvironment`` too).
        **kwargs: Passed to ``cls`` for each episode's instance.

    Raises:
        EnvironmentSpecError: As `openenv_environment` says.

    """
    label = f"{OPENENV_PREFIX}{getattr(cls, '__qualname__', cls)}"
    key = (cls, repr(sorted(kwargs.items())))
    if key not in _CLASSES:
        _CLASSES[key] = build_class(_class_spec(cls, kwargs, label), cls.__name__)
    return _CLASSES[key]


def _local_spec(where: str, kwargs: dict[str, Any]) -> tuple[OpenEnvSpec, dict[str, Any] | None]:
    """How to play the OpenEnv ``Environment`` class `where` names, and its action schema."""
    label = f"{OPENENV_PREFIX}{where}"
    import_openenv(label)
    return _class_spec(load_attribute(where, inspect.isclass), kwargs, label)


def _class_spec(
    cls: Any, kwargs: dict[str, Any], label: str
) -> tuple[OpenEnvSpec, dict[str, Any] | None]:
    """How to play OpenEnv ``Environment`` class `cls` in this process, and its action schema."""
    core = import_openenv(label)
    if not (inspect.isclass(cls) and issubclass(cls, core.Environment)):
        raise EnvironmentSpecError(
            f"{label} names {getattr(cls, '__qualname__', cls)!r}, which is not an OpenEnv "
            "Environment (a subclass of openenv.core.Environment); for an agentgrpo "
            "environment class, drop the openenv: prefix"
        )
    mcp = core.MCPEnvironment is not None and issubclass(cls, core.MCPEnvironment)
    action = None if mcp else action_class(cls, label)

    def make() -> Any:
        return cls(**kwargs)

    spec = OpenEnvSpec(lambda: LocalSession(make, action, label), label)
    return spec, None if action is None else action.model_json_schema()


def _union(hints: list[Any]) -> Any:
    return functools.reduce(operator.or_, hints)


def _marked(shown: str | list[Any], mark: str) -> str | list[Any]:
    if isinstance(shown, str):
        return shown + mark
    return [f"{shown[0]}{mark}", *shown[1:]]
