"""Which methods of an environment class are tools, and whether a class meets the contract.

Tool discovery is static: it reads the class, never instantiates it, so checking a class has no
side effects. A tool is a public name (no leading ``_``), not reserved, whose class attribute is a
plain function (sync or ``async def``), inherited ones included. Classmethods, staticmethods,
properties, other descriptors and non-callables are not tools. A public method wrapped by
``functools.lru_cache`` or ``functools.cache`` is refused (`EnvironmentSpecError`), and so is an
instance attribute that hides a tool (`tool_method`, when an episode binds its tools).

How the engine calls them: each episode has its own instance, and the tool calls of one model
turn on that instance run one at a time, in the order the model wrote them, so a tool may read
and change ``self`` without a lock. Different episodes (different instances) run concurrently,
and so do calls to plain tool functions (``tools=[...]``), which must not share mutable state.
A sync method runs in a daemon thread; one that outlives its timeout is abandoned, not stopped,
and may still run while later calls do, so a tool should return within the timeout. Anything a
method raises, ``SystemExit`` and ``KeyboardInterrupt`` included, is that method's failure: a
tool's becomes an error message for the model, and ``__init__``, ``reset``, ``reward`` or
``close`` failing stops the run with an error naming the class and the method.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from environments.errors import EnvironmentSpecError, async_method_message, both_rewards_message
from environments.seats import SEAT_MEMBERS, check_seats, is_seated
from tools import Tool, ToolDefinitionError, as_tool

RESERVED_NAMES: frozenset[str] = frozenset(
    {
        "reset",
        "reward",
        "get_reward",
        "close",
        "dataset",
        "demonstrations",
        "done",
        "episode_limits",
        "run_defaults",
        "respond",
        "turn_reward",
        "state_key",
        "context_policy",
    }
)
"""Names with a meaning in the contract; never exposed to the model as tools."""


@runtime_checkable
class Environment(Protocol):
    """An environment: a class with ``reset``; its other public plain methods are tools.

    ``reset`` is the one required member. The engine creates a fresh instance per episode and
    calls ``reset`` with the dataset row's columns it names, by name (all of them if it takes
    ``**row``), plus ``seed`` if it has a ``seed`` parameter. It returns text to append to the
    last user message, or None. Its parameters are typed ``*args, **row`` here only so that a
    type checker accepts any parameter list; the engine never passes one positionally.

    ``isinstance(env, Environment)`` checks only that ``reset`` exists; `check_environment`
    checks a class against the whole contract, the optional members included.

    Optional members (a class without them is still an environment, so they are documented
    here rather than declared; a checker cannot express an optional method):

    - ``reward(self) -> float`` (or ``get_reward``, TRL's name; not both): the episode's reward
      from the final state, sync or ``async def``, a finite number. A ``reward`` that is not a
      method (``self.reward = 0.0``, as TRL's OpenEnv examples keep their score) is the class's
      own state: the engine never reads it, and reward functions may
      (``reward_funcs=[lambda environments, **kw: [e.reward for e in environments]]``).
    - ``close(self) -> None``: called when the episode ends, failed or not; synchronous. Not
      called while a method that timed out (``environment_timeout_s``) may still run.
    - ``respond(self, message: str) -> str | None``: called when the model ends a turn without
      a tool call, with its text; the text it returns is the next user turn, None ends the
      episode (`environments.replies`). Synchronous.
    - ``turn_reward(self) -> float | None``: the reward of the turn just played, read after its
      tool calls (per-turn credit, ``turn_advantage``); ``state_key(self) -> str``: equal for
      equal states (``turn_advantage="same_state"``). Both synchronous.
    - ``context_policy``: a class attribute naming the policy (``"truncate"``,
      ``"summarize"``) its long episodes use when the run names none (`rollout.compaction`).
    - ``done``: a bool attribute or property; setting it true ends the episode after the current
      turn's tool calls. Never a method (a method is always true). A property is read in a
      daemon thread under ``environment_timeout_s``; a plain attribute is read in place.
    - ``dataset(cls, split: str = "train")``: a classmethod returning the task rows (a
      ``datasets.Dataset``), used when no dataset is given.
    - ``demonstrations(cls, n: int, seed: int = 0) -> list[list[dict]]``: a classmethod
      returning ``n`` chat conversations that show the tool-call format, for a warm start.
    - ``episode_limits``: a class attribute, a dict with ``max_completion_length`` (tokens per
      episode, tool turns included) and/or ``max_turns`` (model turns): what an episode needs
      to reach its reward. ``agentgrpo run`` and ``agentgrpo eval`` use them unless the command
      line or the config file sets those options (see `episode_limits`).
    - ``run_defaults``: a class attribute, a dict of training options (`RUN_DEFAULT_KEYS`)
      with which this environment's default run learns, e.g. a longer warm start; ``agentgrpo
      run`` uses them unless the command line or the config file sets them (see
      `run_defaults`).

    Examples:
        >>> from environments import Counter
        >>> isinstance(Counter(), Environment), isinstance(object(), Environment)
        (True, False)

    """

    def reset(self, *args: Any, **row: Any) -> str | None:
        """Start an episode on this instance; return text for the prompt, or None."""
        ...


class _Unbound:
    """Stands in for ``self`` so a tool's schema can be built without instantiating its class."""


def tool_names(cls: type) -> list[str]:
    """Return the names of the tool methods of an environment class, sorted.

    Args:
        cls: An environment class (not an instance).

    Returns:
        Public, non-reserved names whose class attribute is a plain function (in a class with
        seats, `environments.seats.SEAT_MEMBERS` are reserved too).

    """
    reserved = RESERVED_NAMES | SEAT_MEMBERS if is_seated(cls) else RESERVED_NAMES
    return sorted(
        name
        for name in dir(cls)
        if not name.startswith("_")
        and name not in reserved
        and inspect.isfunction(inspect.getattr_static(cls, name))
    )


def _refuse_cached_methods(cls: type) -> None:
    """Refuse a public method wrapped by ``functools.lru_cache`` or ``functools.cache``.

    It reads as a tool, but is not a plain function: left out silently, the model would lack a
    tool its author meant it to have; made a tool, its cache would keep every episode's
    instance alive and answer from before the state changed.

    Raises:
        EnvironmentSpecError: Naming the class, the method and the fix.

    """
    for name in dir(cls):
        found = inspect.getattr_static(cls, name)
        if name.startswith("_") or name in RESERVED_NAMES or inspect.isfunction(found):
            continue
        if callable(found) and hasattr(found, "cache_info") and hasattr(found, "__wrapped__"):
            raise EnvironmentSpecError(
                f"{cls.__qualname__}.{name} is a public method, so it would be a tool, but "
                "functools.lru_cache (or functools.cache) wraps it: that cache keeps every "
                "episode's instance alive and answers from before the state changed. Remove "
                "the decorator (cache inside the method, e.g. in a dict on self), or rename "
                "it with a leading underscore if the model should not call it."
            )


def environment_tools(env: object) -> dict[str, Tool]:
    """Build a `Tool` for each tool method of a live environment, bound to that instance.

    Args:
        env: An environment instance; each episode has its own, so tools see its state.

    Returns:
        Tool name to `Tool`, in sorted name order.

    Raises:
        EnvironmentSpecError: A tool method lacks type hints or a usable docstring, or a
            public method is cached (`functools.lru_cache`), which no tool may be.

    """
    cls = type(env)
    _refuse_cached_methods(cls)
    return {name: _as_method_tool(cls, name, getattr(env, name)) for name in tool_names(cls)}


def tool_method(env: object, name: str) -> Any:
    """The tool method `name` of a live environment, bound to it, for the model to call.

    Raises:
        EnvironmentSpecError: An attribute set on the instance (e.g. ``self.submit = None`` in
            ``reset``) hides the class's tool of that name, so every call would fail; the
            message names the class, the tool and the attribute.

    """
    shadow = getattr(env, "__dict__", {})
    if name in shadow:
        cls = type(env).__qualname__
        raise EnvironmentSpecError(
            f"{cls}.{name} is a tool, but the instance attribute self.{name} (a "
            f"{type(shadow[name]).__name__}, set in __init__ or reset) hides it, so every "
            f"call the model makes to {name} would fail; rename the attribute (e.g. "
            f"self._{name}) or the tool"
        )
    return getattr(env, name)


def class_tools(cls: type) -> dict[str, Tool]:
    """Build the schema of each tool method of a class once, without an instance.

    The returned tools are bound to a placeholder, not to an environment: rebind each episode's
    instance before calling them, e.g. ``dataclasses.replace(tool, fn=getattr(env, name))``.

    Raises:
        EnvironmentSpecError: A tool method lacks type hints or a usable docstring, or a
            public method is cached (`functools.lru_cache`), which no tool may be.

    """
    _refuse_cached_methods(cls)
    placeholder = _Unbound()
    return {
        name: _as_method_tool(cls, name, inspect.getattr_static(cls, name).__get__(placeholder))
        for name in tool_names(cls)
    }


def check_environment(cls: type, factory: Callable[[], Any] | None = None) -> None:
    """Check that a class meets the `Environment` contract, without instantiating it.

    Checks that the engine can make an instance with no arguments, that ``reset`` is a plain
    method whose parameters can be passed by name, that every tool method yields a JSON
    schema, and that the optional members have the right kind: at most one of the ``reward``
    and ``get_reward`` methods (a non-callable one is state), a ``close`` method, ``reset`` and
    ``close`` not ``async def``, ``dataset`` and
    ``demonstrations`` classmethods, ``done`` not a method (it is read as a bool, and a method
    is always truthy). A class with ``seats`` meets the seat contract too
    (`environments.seats.check_seats`).

    Args:
        cls: The environment class to check.
        factory: What makes the instances, when it is not `cls` itself (a function, or
            ``functools.partial(cls, size=3)``); then ``cls.__init__`` may require arguments.

    Raises:
        EnvironmentSpecError: The first problem found, naming the class, the member and the fix.

    """
    if not inspect.isclass(cls):
        raise EnvironmentSpecError(f"expected an environment class, got {cls!r}")
    if factory is None or factory is cls:
        _check_init(cls)
    _check_reset(cls)
    _check_methods(cls)
    for member in _CALLED_ON_THE_CLASS:
        _check_classmethod(cls, member)
    if inspect.isfunction(inspect.getattr_static(cls, "done", None)):
        raise EnvironmentSpecError(
            f"{cls.__qualname__}.done is a method, but the engine reads `done` as a bool and a "
            "method is always true; make it an attribute (set self.done = True) or a @property"
        )
    check_seats(cls)
    episode_limits(cls)
    run_defaults(cls)
    class_tools(cls)


def _check_init(cls: type) -> None:
    """Refuse a class whose ``__init__`` requires arguments: the engine calls ``cls()``."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read; making an instance will tell
        return
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p.name for p in parameters if p.default is p.empty and p.kind not in variadic]
    if required:
        name = cls.__qualname__
        raise EnvironmentSpecError(
            f"{name}.__init__ requires {', '.join(map(repr, required))}, but the engine makes "
            f"each episode's instance with no arguments, as {name}(); give the parameters "
            f"defaults, or pass a factory that supplies them, e.g. environment_factory="
            f"functools.partial({name}, {required[0]}=...)"
        )


def reward_method_name(cls: type) -> str | None:
    """The name of the class's reward method, ``reward`` or ``get_reward``; None if it has none.

    Only a method counts: a ``reward`` attribute that is not callable is the class's state.

    Raises:
        EnvironmentSpecError: The class has both methods.
    """
    present = [m for m in ("reward", "get_reward") if callable(getattr(cls, m, None))]
    if len(present) == 2:
        raise EnvironmentSpecError(both_rewards_message(cls.__qualname__))
    return present[0] if present else None


def _check_methods(cls: type) -> None:
    """One reward method at most; ``close`` and ``respond`` are sync methods."""
    name = cls.__qualname__
    reward_method_name(cls)
    if hasattr(cls, "close") and not callable(cls.close):
        raise EnvironmentSpecError(
            f"{name}.close must be a method `def close(self)`, not {type(cls.close).__name__}"
        )
    for member in ("close", "respond", "turn_reward", "state_key"):
        if inspect.iscoroutinefunction(getattr(cls, member, None)):
            raise EnvironmentSpecError(async_method_message(name, member))
    if hasattr(cls, "respond") and not inspect.isfunction(inspect.getattr_static(cls, "respond")):
        raise EnvironmentSpecError(
            f"{name}.respond must be a method `def respond(self, message: str) -> str | None`"
        )


_CALLED_ON_THE_CLASS = {
    "dataset": "returning the task rows",
    "demonstrations": "`demonstrations(cls, n, seed=0)` returning conversations for a warm start",
}


def _check_classmethod(cls: type, member: str) -> None:
    """`member`, if the class has it, is a classmethod (or staticmethod): it has no instance."""
    if hasattr(cls, member) and not isinstance(
        inspect.getattr_static(cls, member), classmethod | staticmethod
    ):
        raise EnvironmentSpecError(
            f"{cls.__qualname__}.{member} must be a @classmethod {_CALLED_ON_THE_CLASS[member]}, "
            "so it can be called without an instance"
        )


EPISODE_LIMITS = ("max_completion_length", "max_turns")
"""The keys an environment's ``episode_limits`` may have."""


def episode_limits(cls: Any) -> dict[str, int]:
    """The class's ``episode_limits`` (an empty dict without one), checked.

    An agent's module (``agent:FILE:function``) may state them the same way, as a module-level
    ``episode_limits``; `cls` is then the module.

    Raises:
        EnvironmentSpecError: It is not a dict, has a key other than `EPISODE_LIMITS`, or a
            value that is not a whole number >= 1.

    Examples:
        >>> from environments import Arithmetic, Counter
        >>> episode_limits(Arithmetic), episode_limits(Counter)
        ({'max_completion_length': 192, 'max_turns': 3}, {})

    """
    example = "{'max_completion_length': 256, 'max_turns': 4}"
    name, limits = _declared_dict(cls, "episode_limits", EPISODE_LIMITS, example)
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EnvironmentSpecError(
                f"{name}.episode_limits[{key!r}] must be a whole number >= 1, not {value!r}"
            )
    return limits


RUN_DEFAULT_KEYS = {
    "max_steps": int,
    "learning_rate": float,
    "warm_start_steps": int,
    "num_generations": int,
    "per_device_train_batch_size": int,
    "max_context": int,
}
"""The keys an environment's ``run_defaults`` may have, and the type of each value."""
_KIND_WORDS = {int: "whole number", float: "number"}


def run_defaults(cls: Any) -> dict[str, float]:
    """The class's ``run_defaults`` (an empty dict without one), checked.

    They are the training options this environment's default run learns with where the
    command line's defaults do not (``warm_start_steps`` applies only when the run warm-starts,
    that is on the embedded default model).

    Raises:
        EnvironmentSpecError: It is not a dict, has a key other than `RUN_DEFAULT_KEYS`, or a
            value that is not a positive number of the key's type.

    Examples:
        >>> from environments import Chain, Counter
        >>> sorted(run_defaults(Chain)), run_defaults(Counter)
        (['learning_rate', 'max_steps', 'per_device_train_batch_size', 'warm_start_steps'], {})

    """
    name, defaults = _declared_dict(cls, "run_defaults", RUN_DEFAULT_KEYS, "{'max_steps': 32}")
    for key, value in defaults.items():
        kind = RUN_DEFAULT_KEYS[key]
        fits = isinstance(value, int if kind is int else (int, float))
        if isinstance(value, bool) or not fits or not value > 0:
            raise EnvironmentSpecError(
                f"{name}.run_defaults[{key!r}] must be a {_KIND_WORDS[kind]} > 0, not {value!r}"
            )
    return defaults


def _declared_dict(
    cls: Any, attribute: str, keys: Iterable[str], example: str
) -> tuple[str, dict[str, Any]]:
    """The class's name and its dict `attribute` (empty without one), its keys among `keys`.

    Raises:
        EnvironmentSpecError: The attribute is not a dict, or has a key not in `keys`.

    """
    declared = inspect.getattr_static(cls, attribute, {})
    name = getattr(cls, "__qualname__", cls.__name__)
    if not isinstance(declared, dict):
        raise EnvironmentSpecError(
            f"{name}.{attribute} must be a dict such as {example}, not {type(declared).__name__}"
        )
    unknown = sorted(set(declared) - set(keys))
    if unknown:
        raise EnvironmentSpecError(f"{name}.{attribute} has {unknown}; its keys are {list(keys)}")
    return name, dict(declared)


def _check_reset(cls: type) -> None:
    name = cls.__qualname__
    reset = getattr(cls, "reset", None)
    if reset is None or not callable(reset):
        raise EnvironmentSpecError(
            f"{name} has no reset() method; an environment needs "
            "`def reset(self, **row) -> str | None` (it may name only the columns it uses)"
        )
    if isinstance(inspect.getattr_static(cls, "reset"), classmethod | staticmethod):
        raise EnvironmentSpecError(
            f"{name}.reset must be a plain instance method: each episode resets its own instance"
        )
    if inspect.iscoroutinefunction(reset):
        raise EnvironmentSpecError(async_method_message(name, "reset"))
    try:
        parameters = list(inspect.signature(reset).parameters.values())[1:]  # [0] is self
    except (TypeError, ValueError):  # a callable without a signature; reset will tell
        return
    positional_only = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if positional_only:
        raise EnvironmentSpecError(
            f"{name}.reset has positional-only parameters {positional_only}; row columns are "
            "passed by name, so remove the '/' from its signature"
        )


def _as_method_tool(cls: type, name: str, method: Any) -> Tool:
    try:
        return as_tool(method, name=name)
    except ToolDefinitionError as error:
        raise EnvironmentSpecError(
            f"{cls.__qualname__}.{name} is a tool because it is a public method, but {error} "
            "If the model should not call it, rename it with a leading underscore."
        ) from error
