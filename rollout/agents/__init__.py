"""Agent episodes: the user's own agent loop, played against the run's chat endpoint.

An agent is an ordinary function written against the OpenAI client:

    async def solve(client: openai.AsyncOpenAI, row: dict) -> float | None: ...
    def solve(client: openai.OpenAI, row: dict) -> float | None: ...  # run in a thread

It may call `client.chat.completions.create(model=..., messages=..., tools=...)` any number of
times, run its own tools and keep its own loop. Each episode gets its own client, pointed at its
own session of `rollout.agents.endpoint.ChatEndpoint`, which records every request token-exactly
(`rollout.agents.session`). What the function returns is the episode's reward: a number, or None
to leave the scoring to reward functions (they see the recorded conversation), or, for an
`Agent` declaring `reward_names`, a dict with one number per name (one reward column each).

An agent that raises, or runs past its timeout, ends its episode with `Finish.ERROR` and the
error as `Episode.error`: the run goes on. A request refused because the episode reached a
limit ends it with `Finish.LENGTH` or `Finish.MAX_TURNS` instead. An `AgentError` the agent
raises is the exception: it found a mistake in its own set-up, and the run stops with it. An
agent that returns or raises without one request answered (none made, or all refused:
malformed, or a first prompt over the limits) is a mistake in the agent, raised as `AgentError`
saying which; an error answering a request that is neither the request's fault nor a limit (a
chat template that cannot show the agent's tools, say) is answered with status 500, and raised
once the agent has returned.

An agent that raises `tools.InfrastructureError` (itself, or as the explicit cause of what it
raises: ``raise ... from InfrastructureError(...)``) says the machinery behind it failed, not
the model nor the agent (a sandbox it runs the model's code in died, a service it calls is
gone): what the episode played is dropped and it is replayed from scratch through a new session,
as an environment's episode is (`rollout.infrastructure`), up to `infra_retries` times; then it
is kept as `Finish.INFRA`, neither scored nor trained on, and left out of its group's baseline.
A timeout is not one: a slow model may cause it.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import anyio

from rollout.agents.endpoint import ChatEndpoint
from rollout.agents.session import AgentSession, SessionContext
from rollout.engine import PlaySetup
from rollout.types import Episode, EpisodeStats, Finish
from tools import infrastructure_failure, run_in_daemon_thread

INSTALL = "pip install 'agentgrpo[agents]'"


class AgentError(RuntimeError):
    """An agent function used wrongly: it never called the endpoint, or returned a bad reward."""


@dataclass(frozen=True)
class Agent:
    """An agent function and what a run needs to know about it.

    Attributes:
        function: `(client, row) -> reward` (see the module docstring); async functions get an
            `openai.AsyncOpenAI`, plain ones an `openai.OpenAI` and run in a worker thread.
        name: The reward column of a function returning a number (default: its `__name__`).
        reward_names: For a function returning a dict: its keys, one reward column each.
        reward_weights: One weight per column of `columns`, the episode's reward being their
            weighted sum (a run's `reward_weights` that covers the columns overrides them);
            empty: 1.0 each.
        dataset: `dataset(split)` giving the task rows, or None (rows come from elsewhere).
        timeout_s: Seconds one episode may take (None: no limit).
        episode_limits: What an episode needs (`max_completion_length`, `max_turns`), as an
            environment's `episode_limits` says it; the command line uses them unless told
            otherwise.
    """

    function: Callable[..., Any]
    name: str = ""
    reward_names: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    dataset: Callable[[str], Any] | None = None
    timeout_s: float | None = 600.0
    episode_limits: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.function):
            raise TypeError(f"an agent must be a function, not a {type(self.function).__name__}")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.function, "__name__", "agent"))
        if self.reward_weights and len(self.reward_weights) != len(self.columns):
            raise ValueError(
                f"agent {self.name} has {len(self.reward_weights)} reward_weights for "
                f"{len(self.columns)} reward columns {list(self.columns)}: give one per column"
            )

    @property
    def columns(self) -> tuple[str, ...]:
        """The reward columns the agent fills, in order."""
        return self.reward_names or (self.name,)

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per column of `columns` (`reward_weights`, else 1.0 each)."""
        return self.reward_weights or (1.0,) * len(self.columns)

    @property
    def is_async(self) -> bool:
        """Whether the function is a coroutine function (it gets an `AsyncOpenAI`)."""
        return inspect.iscoroutinefunction(self.function) or inspect.iscoroutinefunction(
            getattr(self.function, "__call__", None)  # noqa: B004  (a callable object's method)
        )

    def player(self, setup: PlaySetup) -> AgentPlayer:
        """What plays an engine's episodes with this agent: `RolloutEngine(player=agent.player)`."""
        return AgentPlayer(self, setup)


class AgentPlayer:
    """Plays every episode of an engine with an agent, each through its own endpoint session.

    Args:
        agent: The agent.
        setup: What the engine shares: the generator, the template and the parsers.

    Attributes:
        endpoint: The chat endpoint the agent's clients reach; it holds its port until `close`.

    Raises:
        OSError: No port to bind on 127.0.0.1.
    """

    def __init__(self, agent: Agent, setup: PlaySetup):
        self.agent = agent
        self.endpoint = ChatEndpoint(getattr(setup.tokenizer, "name_or_path", "") or "agentgrpo")
        self.sessions = SessionContext(
            setup.backend,
            setup.tokenizer,
            setup.template,
            setup.parser_for,
            setup.config,
            setup.template_kwargs,
        )

    def serving(self) -> AbstractAsyncContextManager[None]:
        """The endpoint answering the agent's requests until the block ends."""
        return self.endpoint.serving()

    async def play(self, row: Mapping[str, Any], seed: int, group: int, index: int) -> Episode:
        """Play episode `index` of `row` (see `run_agent_episode`)."""
        return await run_agent_episode(
            self.agent, self.endpoint, self.sessions, row, seed, group, index
        )

    def close(self) -> None:
        """Give the endpoint's port back."""
        self.endpoint.close()


async def run_agent_episode(
    agent: Agent,
    endpoint: ChatEndpoint,
    context: SessionContext,
    row: Mapping[str, Any],
    seed: int,
    group: int,
    index: int,
) -> Episode:
    """Play one episode of `row` with `agent` through its own session of `endpoint`.

    Raises:
        AgentError: The agent made no request, or none the endpoint answered, returned
            something that is not a reward, or raised `AgentError` itself.
        InfrastructureError: The agent raised one (or one as its error's cause): the engine
            replays the episode (`rollout.infrastructure.play_retrying`).
    """
    session = AgentSession(context, sample_seed=hash((seed, index)))
    base_url = endpoint.open(session)
    infrastructure: Exception | None = None
    try:
        outcome, error = await _call_agent(agent, base_url, dict(row))
    except Exception as failure:
        if infrastructure_failure(failure) is None:
            raise
        infrastructure, outcome, error = failure, None, None
    finally:
        endpoint.close_session(base_url)
    where = f"agent {agent.name} ({_where(agent.function)})"
    if session.failure is not None:  # not the model's doing, nor the agent's: say it loudly
        raise session.failure
    if infrastructure is not None:  # what it played is dropped: the replay plays it afresh
        raise infrastructure
    what = f"raised {error}" if error else "returned"
    if session.received == 0:
        raise AgentError(
            f"{where} {what} without calling the endpoint; it must ask the model through "
            f"client.chat.completions.create(...) with the client it is given"
        )
    if not session.rows():
        refused = f"{session.refusals} refused, the last with: {session.last_refusal}"
        raise AgentError(
            f"{where} {what} after {session.received} request(s) to the endpoint, none "
            f"answered ({refused if session.refusals else 'none refused'})"
        )
    return Episode(
        rows=session.rows(),
        messages=session.messages,
        finish=_finish(session, error),
        stats=EpisodeStats(
            session.requests,
            session.tool_calls,
            {"parse": session.parse_errors} if session.parse_errors else {},
            compactions=tuple(session.compactions),
        ),
        row=row,
        group=group,
        index=index,
        error=None if session.refused else error,
        tool_calls=session.tool_call_records(),
        agent_rewards=None if error else agent_rewards(agent, outcome, where),
    )


async def _call_agent(agent: Agent, base_url: str, row: dict[str, Any]) -> tuple[Any, str | None]:
    """The agent's return value and None, or None and why it failed (an error or a timeout).

    Raises:
        AgentError: The agent raised it.
        Exception: What the agent raised, when it is an infrastructure failure
            (`tools.infrastructure_failure`).
    """
    import openai

    limit = math.inf if agent.timeout_s is None else agent.timeout_s
    try:
        with anyio.fail_after(limit):
            if agent.is_async:
                async with openai.AsyncOpenAI(
                    base_url=base_url, api_key="agentgrpo", max_retries=0
                ) as client:
                    return await agent.function(client, row), None
            with openai.OpenAI(base_url=base_url, api_key="agentgrpo", max_retries=0) as client:
                call = functools.partial(agent.function, client, row)
                return await run_in_daemon_thread(call, label=f"agent {agent.name}"), None
    except TimeoutError:
        return None, f"TimeoutError: the agent ran past its {agent.timeout_s} s timeout"
    except AgentError:
        raise
    except Exception as failure:
        if infrastructure_failure(failure) is not None:
            raise
        return None, f"{type(failure).__name__}: {failure}"


def _finish(session: AgentSession, error: str | None) -> Finish:
    if session.refused is not None:
        return session.refused
    if error is not None:
        return Finish.ERROR
    return Finish.LENGTH if session.cut_off else Finish.STOP


def agent_rewards(agent: Agent, outcome: Any, where: str) -> dict[str, float | None]:
    """The reward columns of what the agent returned (see `Agent`).

    Raises:
        AgentError: A dict from an agent without `reward_names`, keys other than them, or a
            value that is not a number or None.
    """
    if not agent.reward_names:
        return {agent.name: _number(outcome, where)}
    if not isinstance(outcome, Mapping) or set(outcome) - set(agent.reward_names):
        raise AgentError(
            f"{where} returned {outcome!r}; it must return a dict with the keys "
            f"{list(agent.reward_names)}"
        )
    return {name: _number(outcome.get(name), where) for name in agent.reward_names}


def _number(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AgentError(
            f"{where} returned {value!r}; it must return the episode's reward (a number) or None"
        )
    return float(value)


def _where(function: Callable[..., Any]) -> str:
    code = getattr(function, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(function)
