"""Environments: plain Python classes whose methods are the model's tools.

The contract (`Environment`, checked by `check_environment`). An environment is any class with
``reset(self, **row) -> str | None``:

- ``reset`` starts an episode on a fresh instance. It receives the dataset row's columns that it
  names as parameters (all of them if it takes ``**kwargs``), and ``seed`` if it has a ``seed``
  parameter; the members of a group share the seed. The text it returns, if any, is appended to
  the last user message.
- Every other public method defined as a plain instance method (sync or async) is a tool: it
  needs type hints and a Google-style docstring with an ``Args:`` entry per parameter.
  Classmethods, staticmethods, properties, private names and the reserved names ``reset``,
  ``reward``, ``close``, ``dataset``, ``demonstrations`` and ``done`` are never tools.
  The calls of one model turn on one instance run one at a time, in the order the model wrote
  them (see `environments.contract` for the rest of how the engine runs them).
- Optional: ``reward(self) -> float`` scores the episode from the final state;
  ``dataset(cls)`` (a classmethod) returns the task rows; ``demonstrations(cls, n, seed)`` (a
  classmethod) returns conversations showing the tool-call format, for a warm start;
  ``close(self)`` is always called when the episode ends; setting ``self.done = True`` ends
  the episode.

Built-ins: `Counter` (one tool), `Arithmetic` (calculate, then submit an answer), `Chain`
(three dependent one-operation calls, then submit), `GuessNumber` (a gymnasium game through
`gym_environment`, the adapter for any ``gymnasium.Env`` with text observations) and
`ColourSquare` (for vision-language models: `reset` returns a picture with its text), `Trail`
(a long chain of boxes whose history outgrows a small window: context compaction) and
`Questions` (a dialogue: the environment answers the model's questions through ``respond``).
docs/environments.md has a runnable example of each shape.

Specs name a class: ``env:Counter`` (built-in), ``gym:FrozenLake-v1`` (a registered gymnasium
env with a text observation, see `environments.gym_ids`), ``package.module:Class`` or
``path/to/file.py:Class``. User mistakes raise `EnvironmentSpecError`, `EnvironmentInitError`,
`EnvironmentResetError`, `EnvironmentRewardError` or `EnvironmentCloseError`, each naming the
class, the method and what to fix.

Examples:
    >>> class Echo:
    ...     def reset(self, word: str) -> str:
    ...         self.word, self.said = word, None
    ...         return f"Say {word}."
    ...
    ...     def say(self, text: str) -> str:
    ...         '''Say something out loud.
    ...
    ...         Args:
    ...             text: What to say.
    ...         '''
    ...         self.said = text
    ...         return text
    ...
    ...     def reward(self) -> float:
    ...         return float(self.said == self.word)
    >>> check_environment(Echo)
    >>> tool_names(Echo)
    ['say']
    >>> env = Echo()
    >>> reset_environment(env, {"word": "hi", "prompt": "(not a reset parameter)"}, seed=0)
    'Say hi.'
    >>> tools = environment_tools(env)
    >>> tools["say"].schema["function"]["parameters"]["required"]
    ['text']
    >>> tools["say"].fn(text="hi")
    'hi'
    >>> import anyio
    >>> anyio.run(read_reward, env), is_done(env)
    (1.0, False)
    >>> resolve_environment("env:Counter") is Counter
    True

"""

from environments.arithmetic import Arithmetic
from environments.chain import Chain
from environments.colour_square import ColourSquare
from environments.contract import (
    RESERVED_NAMES,
    Environment,
    check_environment,
    class_tools,
    environment_tools,
    reward_method_name,
    tool_method,
    tool_names,
)
from environments.counter import Counter
from environments.errors import (
    EnvironmentCloseError,
    EnvironmentDoneError,
    EnvironmentInitError,
    EnvironmentResetError,
    EnvironmentRespondError,
    EnvironmentRewardError,
    EnvironmentSpecError,
    EnvironmentTimeoutError,
)
from environments.guess_number import GuessNumber, GuessNumberGame
from environments.gym_adapter import GymEnvironment, gym_environment
from environments.lifecycle import (
    add_close_note,
    close_after_failure,
    close_environment,
    create_environment,
    init_name,
    is_done,
    read_done,
    read_reward,
    reset_environment,
    run_environment_code,
    run_environment_code_blocking,
)
from environments.questions import Questions
from environments.reasoning_gym_tasks import (
    ReasoningGymTask,
    reasoning_gym_environment,
    task_names,
)
from environments.replies import (
    gives_turn_rewards,
    respond_text,
    responds,
    state_key_text,
    turn_reward_value,
)
from environments.resolve import BUILTIN_ENVIRONMENTS, resolve_environment
from environments.trail import Trail
from tools import InfrastructureError  # a method raises it when its machinery failed

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "RESERVED_NAMES",
    "Arithmetic",
    "Chain",
    "ColourSquare",
    "Counter",
    "Environment",
    "EnvironmentCloseError",
    "EnvironmentDoneError",
    "EnvironmentInitError",
    "EnvironmentResetError",
    "EnvironmentRespondError",
    "EnvironmentRewardError",
    "EnvironmentSpecError",
    "EnvironmentTimeoutError",
    "GuessNumber",
    "GuessNumberGame",
    "GymEnvironment",
    "InfrastructureError",
    "Questions",
    "ReasoningGymTask",
    "Trail",
    "add_close_note",
    "check_environment",
    "class_tools",
    "close_after_failure",
    "close_environment",
    "create_environment",
    "environment_tools",
    "gives_turn_rewards",
    "gym_environment",
    "init_name",
    "is_done",
    "read_done",
    "read_reward",
    "reasoning_gym_environment",
    "reset_environment",
    "resolve_environment",
    "respond_text",
    "responds",
    "reward_method_name",
    "run_environment_code",
    "run_environment_code_blocking",
    "state_key_text",
    "task_names",
    "tool_method",
    "tool_names",
    "turn_reward_value",
]
