"""verifiers environments as agents: `vf:ENV_ID` plays an installed verifiers environment.

verifiers (0.4, `import verifiers.v1 as vf`) splits an environment into a taskset (its tasks,
each with `@vf.reward` functions), a harness (the program that plays a task against an
OpenAI-compatible endpoint) and an `Env` that composes them; an environment is found by the id
of its taskset, an installed module exporting a `vf.Taskset` subclass in `__all__`.
`verifiers_agent(env_id, env_args)` loads one with `vf.load_environment` and makes it a
`rollout.agents.Agent`, so a run plays it through its chat endpoint like any agent:

- rows: one per task of the taskset, `{"prompt": the prompt's text, "task": the task's data as
  JSON}`, the data verifiers itself sends a served environment to rebuild the task. A taskset
  has no splits: "eval" is its last tenth of the tasks (at least one), "train" the others.
- an episode: the environment's own `run_episode` of the row's task, every model call of its
  harness going through verifiers' interception to the episode's session of the endpoint (with
  `logprobs` and `return_token_ids` asked for), where it is recorded token-exactly. Sampling
  is the run's, whatever the environment's config asks.
- rewards: one reward column per reward function (and judge) of the taskset, holding its score,
  weighted by its verifiers weight (`Agent.reward_weights`): the reward GRPO trains on is their
  weighted sum, verifiers' own `trace.reward`, and each function is logged on its own.
- limits: the agent seat's `max_turns` is the run's (`Agent.episode_limits`), unless the
  command line says otherwise.
- a failed episode (verifiers' `episode.ok` is false: the harness, a task hook or the scoring
  raised) ends with `Finish.ERROR` and verifiers' error message; the run goes on. One whose
  every recorded error is a `vf.SandboxError`, `vf.InterceptionError` or `vf.TunnelError`
  (`INFRASTRUCTURE_ERRORS`: its sandbox or its link to the endpoint failed) is an
  infrastructure failure instead: replayed, then kept as `Finish.INFRA` (`rollout.agents`).

Mistakes in the set-up are loud: `VerifiersEnvError` (a `ValueError`) when loading, and
`AgentError` for an episode that does not fit (several trainable agent runs, a reward that was
not declared up front).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout.agents import Agent, AgentError
from tools import InfrastructureError
from tools.threads import shield_unless_interrupted

if TYPE_CHECKING:
    from verifiers.v1 import EnvConfig

logger = logging.getLogger(__name__)

INSTALL = "pip install 'agentgrpo[verifiers]'"
MODEL = "agentgrpo"
"""The model name the harness asks for; the endpoint answers with the policy whatever it is."""
API_KEY_VARIABLE = "AGENTGRPO_VF_API_KEY"
"""Where verifiers' client reads its key (unset: "EMPTY"); the endpoint needs none."""
LOCAL_RUNTIME = {"type": "subprocess"}
INFRASTRUCTURE_ERRORS = frozenset({"SandboxError", "InterceptionError", "TunnelError"})
"""verifiers' error types (`vf.SandboxError`, ...) that say its machinery failed, not the model:
a sandbox (provisioning, exec, file I/O) or the link to the interception server. An episode
whose every recorded error is one of them is an infrastructure failure."""


class VerifiersEnvError(ValueError):
    """A verifiers environment that cannot be loaded or played as asked; says what to fix."""


def verifiers_v1() -> Any:
    """The module `verifiers.v1`, or a `VerifiersEnvError` that says how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        found = importlib.util.find_spec("verifiers") is not None
        why = "is too old (no verifiers.v1)" if found else "is not installed"
        raise VerifiersEnvError(
            f"vf: environments need the verifiers package (0.4), which {why}: {INSTALL}"
        ) from error
    return vf


def verifiers_agent(env_id: str, env_args: Mapping[str, Any] | None = None) -> Agent:
    """The agent playing verifiers environment `env_id` (see the module docstring).

    Args:
        env_id: The environment's taskset id: an installed module (`my-env` is `my_env`)
            exporting a `vf.Taskset` subclass in `__all__`.
        env_args: verifiers' env config, as `vf-eval --env.*` sets it: taskset knobs under
            `"taskset"`, the agent's seat (harness, runtime, limits) under its name
            (`"agent"`). A seat left on verifiers' default remote runtime (prime) runs in a
            local subprocess.

    Raises:
        VerifiersEnvError: verifiers is missing, no such environment is installed, `env_args`
            do not fit its config, it retries episodes, or it has no tasks or no rewards.
    """
    vf = verifiers_v1()
    config = _env_config(vf, env_id, dict(env_args or {}))
    try:
        env = vf.load_environment(config)
        tasks = list(env.taskset) if env.taskset.bounded else None
    except Exception as error:
        raise VerifiersEnvError(
            f"vf:{env_id}: loading the environment raised {type(error).__name__}: {error}"
        ) from error
    if not tasks:
        what = "is infinite" if tasks is None else "has no tasks"
        raise VerifiersEnvError(
            f"vf:{env_id}: its taskset {what}; agentgrpo needs the tasks listed up front "
            f"(bound it with one of its own settings in --env-args)"
        )
    episodes = _Episodes(env_id, env, tasks)
    return Agent(
        episodes,
        name=f"vf-{_module_name(env_id)}",
        reward_names=tuple(episodes.weights),
        reward_weights=tuple(episodes.weights.values()),
        dataset=episodes.rows,
        episode_limits=_episode_limits(config),
    )


def _episode_limits(config: EnvConfig) -> dict[str, int]:
    """The agent seat's own turn cap (its `max_turns`) as the run's `max_turns`.

    Only with one agent seat, whose cap is then the trained agent's; verifiers' token caps
    count differently from `max_completion_length` (outputs only, not tool results) and stay
    verifiers' own.
    """
    from verifiers.v1.configs.agent import agent_config_fields

    seats = list(agent_config_fields(config).values())
    if len(seats) != 1 or not seats[0].max_turns:
        return {}
    return {"max_turns": seats[0].max_turns}


class _Episodes:
    """Plays episodes of one loaded environment; the `Agent.function` and `Agent.dataset`.

    Args:
        env_id: The id the environment was loaded by (for messages).
        env: The loaded `vf.Env`.
        tasks: Its taskset's tasks, in order.

    Raises:
        VerifiersEnvError: The tasks declare no reward.
    """

    def __init__(self, env_id: str, env: Any, tasks: list[Any]):
        self.env_id = env_id
        self.env = env
        self.tasks = tasks
        self.serving = SharedServing(env, f"vf:{env_id}")
        self.task_type = type(tasks[0])
        self.weights = _reward_weights(tasks[0])
        if not self.weights:
            raise VerifiersEnvError(
                f"vf:{env_id}: its tasks ({self.task_type.__name__}) declare no reward: give "
                f"them a @vf.reward method (or a judge) to train on"
            )

    def rows(self, split: str = "train") -> Any:
        """The task rows of `split`: "eval" is the last tenth of the tasks, any other the rest."""
        import datasets

        held_out = max(1, len(self.tasks) // 10) if len(self.tasks) > 1 else 0
        if split == "eval" and not held_out:
            raise VerifiersEnvError(
                f"vf:{self.env_id} has one task, none to hold out for eval; give the taskset "
                f"more tasks (or pass eval rows with --dataset)"
            )
        first_held_out = len(self.tasks) - held_out
        chosen = self.tasks[first_held_out:] if split == "eval" else self.tasks[:first_held_out]
        return datasets.Dataset.from_list(
            [{"prompt": task.data.prompt_text, "task": _task_json(task)} for task in chosen]
        )

    async def __call__(self, client: Any, row: Mapping[str, Any]) -> dict[str, float | None]:
        """Play the row's task with the environment against `client`'s endpoint; its rewards.

        Raises:
            RuntimeError: verifiers reports the episode failed (it ends as `Finish.ERROR`).
            InfrastructureError: It failed for `INFRASTRUCTURE_ERRORS` only (it is replayed).
            InfrastructureError: It failed for `INFRASTRUCTURE_ERRORS` only (it is replayed).
            AgentError: The episode does not fit a run (see `rewards`).
        """
        vf = verifiers_v1()
        context = vf.ModelContext(
            model=MODEL,
            client=vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=API_KEY_VARIABLE),
            sampling=vf.SamplingConfig(logprobs=True, return_token_ids=True),
        )
        task = self.task(row)
        async with self.serving():
            episode = await self.env.run_episode(task, context)
        return self.rewards(episode, context.client.base_url)

    def task(self, row: Mapping[str, Any]) -> Any:
        """The task a row names, rebuilt from its data as verifiers' own env server does.

        Raises:
            AgentError: The row has no `task` holding the taskset's task data.
        """
        data_type = self.task_type.data_type()
        try:
            data = data_type.model_validate_json(row["task"])
        except Exception as error:
            raise AgentError(
                f"vf:{self.env_id} plays rows made by its own dataset(), whose 'task' column "
                f"holds a {data_type.__name__} as JSON; this row does not ({error})"
            ) from None
        return self.task_type(data, self.env.config.taskset.task)

    def rewards(self, episode: Any, policy_url: str) -> dict[str, float | None]:
        """Each reward column's score in a finished episode (None where it was not scored).

        Args:
            episode: The `vf.Episode` played.
            policy_url: The endpoint session it played against (the policy's).

        Raises:
            InfrastructureError: The episode failed with `INFRASTRUCTURE_ERRORS` only: it
                is replayed (`rollout.agents`).
            RuntimeError: The episode failed otherwise: verifiers' errors, the last first.
            AgentError: It holds other than one trainable agent run, or an untrainable seat
                that asked the policy (its turns would be trained on), or a reward not
                declared up front (one returning a dict, or recorded by `Env.finalize`), or
                one weighted otherwise than declared.
        """
        if not episode.ok:
            errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            detail = "; ".join(f"{e.type}: {e.message}" for e in reversed(errors))
            failed = f"the verifiers episode failed: {detail or 'no error recorded'}"
            if errors and all(e.type in INFRASTRUCTURE_ERRORS for e in errors):
                raise InfrastructureError(failed)
            raise RuntimeError(failed)
        for trace in episode.traces:
            seat = trace.agent
            client = seat.config.client if seat is not None else None
            asked_policy = client is not None and client.base_url == policy_url
            if asked_policy and trace.num_turns and not seat.trainable:
                raise AgentError(
                    f"vf:{self.env_id}: seat {seat.name!r} is not trainable but asked "
                    f"the policy, whose every turn is trained on; give it a model and client of "
                    f"its own in --env-args"
                )
        trained = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        if len(trained) != 1:
            raise AgentError(
                f"vf:{self.env_id} played {len(trained)} trainable agent runs in one episode; "
                f"agentgrpo trains one agent run per episode"
            )
        [trace] = trained
        for name, reward in trace.rewards.items():
            if name not in self.weights:
                raise AgentError(
                    f"vf:{self.env_id} recorded reward {name!r}, which its tasks do not declare "
                    f"({', '.join(self.weights)}); agentgrpo needs every reward's name before "
                    f"the run starts, so a @vf.reward must return one number, not a dict"
                )
            if reward is not None and reward.weight != self.weights[name]:
                raise AgentError(
                    f"vf:{self.env_id} recorded reward {name!r} with weight {reward.weight}, "
                    f"not the {self.weights[name]} it declared"
                )
        return {
            name: None if (reward := trace.rewards.get(name)) is None else reward.score
            for name in self.weights
        }


class SharedServing:
    """`env.serving()`, held open while any episode of the running event loop plays.

    verifiers brings an environment's shared resources up once in `env.serving()` (its
    interception server, the taskset's shared tool servers, `Env.start`) and plays every
    episode inside it. Here episodes start and end on their own, and each round runs in an
    event loop of its own, so the first episode to come opens the context, in a task of its own
    (a context must close in the task that opened it), later ones join it, and the last one to
    leave closes it; one that comes while it closes waits, then opens it again.

    Args:
        env: The loaded `vf.Env`.
        label: The environment, for messages.
    """

    def __init__(self, env: Any, label: str):
        self.env = env
        self.label = label
        self._state: _Held | None = None

    @contextlib.asynccontextmanager
    async def __call__(self) -> AsyncIterator[None]:
        """Play inside `env.serving()` until the block ends.

        Raises:
            AgentError: Opening `env.serving()` raised (a set-up error; the run stops).
        """
        loop = asyncio.get_running_loop()
        if self._state is None or self._state.loop is not loop:
            self._state = _Held(loop, asyncio.Lock())
        state = self._state
        async with state.lock:
            if not state.users:
                await self._open(state)
            state.users += 1
        try:
            yield
        finally:
            with shield_unless_interrupted():  # an episode cut off by its timeout too; not Ctrl-C
                async with state.lock:
                    state.users -= 1
                    if not state.users:
                        await self._close(state)

    async def _open(self, state: _Held) -> None:
        opened = state.loop.create_future()
        state.closing = asyncio.Event()
        state.holder = state.loop.create_task(self._hold(opened, state.closing))
        try:
            await opened
        except asyncio.CancelledError:
            state.closing.set()  # no one will use it: the holder closes it once open
            raise
        except Exception as error:
            raise AgentError(
                f"{self.label}: bringing up the environment (env.serving()) raised "
                f"{type(error).__name__}: {error}"
            ) from error

    async def _hold(self, opened: asyncio.Future[None], closing: asyncio.Event) -> None:
        try:
            async with self.env.serving():
                opened.set_result(None)
                await closing.wait()
        except BaseException as error:
            if opened.done():
                raise
            opened.set_exception(error)

    async def _close(self, state: _Held) -> None:
        assert state.closing is not None and state.holder is not None
        state.closing.set()
        try:
            await state.holder
        except Exception:  # the episodes are played; a teardown failure is only reported
            logger.warning("%s: closing env.serving() failed", self.label, exc_info=True)


@dataclass
class _Held:
    """`SharedServing`'s state in one event loop: the users, and the task holding the context."""

    loop: asyncio.AbstractEventLoop
    lock: asyncio.Lock
    users: int = 0
    closing: asyncio.Event | None = None
    holder: asyncio.Task[None] | None = None


def _env_config(vf: Any, env_id: str, env_args: dict[str, Any]) -> EnvConfig:
    """The env config (verifiers') of `env_id`: `env_args` over agentgrpo's defaults.

    Raises:
        VerifiersEnvError: No such environment, `env_args` that do not fit, or retries.
    """
    from verifiers.v1.configs.agent import agent_config_fields

    taskset = env_args.get("taskset")
    if isinstance(taskset, Mapping) and taskset.get("id", env_id) != env_id:
        raise VerifiersEnvError(
            f"--env-args names taskset {taskset['id']!r}, but the environment is vf:{env_id}; "
            f"leave the taskset's id out of --env-args"
        )
    try:
        vf.taskset_config_type(env_id)  # imports the module and finds its Taskset
        config_type = vf.env_config_type(env_id)
    except ModuleNotFoundError as error:
        raise _not_installed(env_id, error) from error
    except Exception as error:
        raise VerifiersEnvError(f"vf:{env_id}: {type(error).__name__}: {error}") from error
    defaults: dict[str, Any] = {"taskset": {"id": env_id}}
    for seat, field in config_type.model_fields.items():
        if isinstance(field.default, vf.AgentConfig) and field.default.runtime.type == "prime":
            defaults[seat] = {"runtime": dict(LOCAL_RUNTIME)}
    try:
        config = vf.resolve_env_config(_merged(defaults, env_args))
    except Exception as error:
        raise VerifiersEnvError(
            f"--env-args does not fit vf:{env_id}'s env config ({config_type.__name__}): "
            f"{_validation_text(error)}"
        ) from None
    seats = {"env": config, **agent_config_fields(config)}
    retrying = [name for name, seat in seats.items() if _retries(seat.retries)]
    if retrying:
        raise VerifiersEnvError(
            f"vf:{env_id} retries failed episodes ({', '.join(retrying)}); agentgrpo records "
            f"every model call of an episode and would train on the abandoned attempts: set "
            f"their retries to 0 in --env-args"
        )
    return config


def _not_installed(env_id: str, error: ModuleNotFoundError) -> VerifiersEnvError:
    """The error for an environment whose module (or one it imports) cannot be imported."""
    module = _module_name(env_id)
    cause = error.__cause__ if isinstance(error.__cause__, ModuleNotFoundError) else error
    if cause.name not in (module, f"verifiers.v1.tasksets.{module}", None):
        return VerifiersEnvError(
            f"vf:{env_id}: module {module!r} imports {cause.name!r}, which is not installed"
        )
    return VerifiersEnvError(
        f"vf:{env_id}: no verifiers environment {env_id!r} is installed: "
        f"verifiers.load_environment imports a module named {module!r} (first "
        f"verifiers.v1.tasksets.{module}) that exports its vf.Taskset subclass in __all__; "
        f"install the environment's package, or put {module}.py on PYTHONPATH"
    )


def _module_name(env_id: str) -> str:
    """The module verifiers imports for `env_id`: `owner/my-env@1.0` is `my_env`."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _task_json(task: Any) -> str:
    """A task's data as JSON, fields at their defaults left out (they come back as defaults)."""
    return str(task.data.model_dump_json(exclude_defaults=True))


def _reward_weights(task: Any) -> dict[str, float]:
    """Each reward a task records, by name, with its weight: its rewards, then its judges."""
    weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in task.hooks("reward")}
    for judge in task.plugged_judges():
        weights[judge.reward_name] = float(judge.config.weight)
    return weights


def _retries(retries: Any) -> bool:
    return retries.max_retries > 0 or any(rule.max_retries for rule in retries.rules)


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on `base`, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in over.items():
        below = merged.get(key)
        if isinstance(below, Mapping) and isinstance(value, Mapping):
            value = _merged(below, value)
        merged[key] = value
    return merged


def _validation_text(error: Exception) -> str:
    """A pydantic validation error as `where: what; ...` on one line (else its text)."""
    details: Sequence[Mapping[str, Any]] = getattr(error, "errors", lambda: [])()
    if not details:
        return f"{type(error).__name__}: {error}"
    return "; ".join(
        f"{'.'.join(str(part) for part in d.get('loc', ())) or '(top)'}: {d.get('msg')}"
        for d in details
    )
