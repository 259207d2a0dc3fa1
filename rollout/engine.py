"""The rollout engine: runs every episode of a batch concurrently, each at its own pace.

There are no lock-step turns: each episode generates, calls its tools and generates again as soon
as it can, and the backend batches whatever requests are pending. A bound on episodes in flight
keeps memory and environment count in check. Episodes of one group share their row and seed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from environments import (
    check_environment,
    class_tools,
    close_environment,
    create_environment,
    init_name,
    run_environment_code_blocking,
)
from environments.seats import refuse_games
from rollout.backend import GenerationBackend
from rollout.compaction import POLICY_NAMES, ContextPolicy, ContextPolicyError, context_policy_of
from rollout.episode import EpisodeConfig, EpisodeContext, run_episode
from rollout.images import is_vision_processor
from rollout.infrastructure import infra_episode, placeholder_token, play_retrying
from rollout.parsers import Parser, detect_parser, get_parser, tokenizer_parser
from rollout.row_tools import RowContexts
from rollout.template import ChatRenderer
from rollout.template_source import load_template
from rollout.types import Episode, ParsedTurn
from tools import InfrastructureError, Tool, as_tool
from tools.mcp import McpServer, McpTools

#: The row column that picks the environment when `environment_factory` is a dict (TRL's name).
ENVIRONMENT_COLUMN = "environment"

Factory = Callable[[], Any]


@dataclass(frozen=True)
class PlaySetup:
    """What the engine shares with an `EpisodePlayer`: the generator, the template, the parsers.

    Attributes:
        backend: The generation backend.
        tokenizer: The policy's tokenizer.
        template: The chat template's jinja source.
        parser_for: Tool schemas to the parser that reads calls to them (`select_parser`).
        config: The episode limits and sampling.
        template_kwargs: Extra template variables.
    """

    backend: GenerationBackend
    tokenizer: Any
    template: str
    parser_for: Callable[[list[dict[str, Any]]], Parser]
    config: EpisodeConfig
    template_kwargs: Mapping[str, Any] | None


class EpisodePlayer(Protocol):
    """Plays each episode in place of the engine's own loop (an agent does: `rollout.agents`)."""

    def serving(self) -> AbstractAsyncContextManager[None]:
        """Held open while a round plays (what the episodes reach meanwhile, an endpoint)."""
        ...

    async def play(self, row: Mapping[str, Any], seed: int, group: int, index: int) -> Episode:
        """Play episode `index` of the round: a member of group `group`, from `row` and `seed`."""
        ...

    def close(self) -> None:
        """Give back what the player holds (a port); called once, by `RolloutEngine.close`."""
        ...


#: Builds the player of an engine from what the engine shares (`Agent.player`, say).
PlayerFactory = Callable[[PlaySetup], EpisodePlayer]


class RolloutEngine:
    """Plays tool-calling episodes through a chat template and a generation backend.

    Args:
        backend: The generator (`TransformersBackend`, a vLLM backend, `ScriptedBackend`...).
        tokenizer: The policy's tokenizer, or a vision-language model's processor: then
            prompts and tool results may hold images (`rollout.images`), rendered with the
            processor's chat template when it has one.
        environment_factory: A zero-argument callable returning a fresh environment (usually
            the environment class itself); or a dict of them by name, where each row's
            `environment` column picks its environment and only that environment's tools (with
            the plain ones) are offered in its episodes, and `reset` never receives that
            column; or None for plain tools only.
        tools: Plain tool functions (typed, Google-style docstrings) offered in every episode.
        chat_template: None (the tokenizer's), a built-in name (`"chatml_tools"`), or jinja.
        tool_call_parser: A parser name (a key of `rollout.PARSERS`: `"hermes"`,
            `"llama3_json"`, `"qwen3_xml"`, ...) or None to use the tokenizer's response parser
            if it has one, else detect it from the template.
        chat_template_kwargs: Extra template variables (e.g. `{"enable_thinking": False}`).
        config: Limits and sampling (`EpisodeConfig`).
        max_concurrent_episodes: The most episodes in flight at once.
        player: Builds what plays each episode in place of the engine's own loop: an
            agent's `Agent.player` (`rollout.agents`), which serves the agent an
            OpenAI-compatible endpoint on 127.0.0.1 while a round plays; then there is no
            environment and no tool here.
        mcp_servers: MCP servers whose tools every episode offers beside the plain tools
            (`tools.mcp`): started here (within `config.environment_timeout_s`) to list
            their tools. A shared server serves all episodes and rounds; a per-episode one
            (`McpServer.per_episode`) is started afresh for each play of an episode and
            stopped when it ends, however it ends. All are stopped by `close()`, or when the
            engine is collected or the interpreter exits.
        infra_retries: How often an episode that a `tools.InfrastructureError` ended (raised
            by a tool, the environment or an MCP server) is replayed from scratch: a fresh
            environment, the same row and seed. After that many it is kept as a failed
            episode (`Finish.INFRA`, see `rollout.infrastructure`). 0: never replayed.

    Raises:
        ToolTemplateError: There are tools but the template cannot show them.
        EnvironmentSpecError: An environment class breaks the contract.
        EnvironmentTimeoutError: A factory that is not a class, called once (and its instance
            closed) to find the class, did not return within `config.environment_timeout_s`.
        ValueError: `environment_factory` is an empty dict, an agent comes with an
            environment or tools, two tools share a name, `infra_retries` is negative, or an
            environment class has seats (a game: `rollout.match.MatchEngine` plays it).
        McpServerError: An MCP server did not start or list its tools.

    """

    plays_seats = False  # a game with seats needs `rollout.match.MatchEngine`

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Any,
        *,
        environment_factory: Factory | Mapping[str, Factory] | None = None,
        tools: Iterable[Callable[..., Any]] = (),
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        config: EpisodeConfig | None = None,
        max_concurrent_episodes: int = 256,
        player: PlayerFactory | None = None,
        mcp_servers: Sequence[McpServer] = (),
        infra_retries: int = 2,
    ):
        if infra_retries < 0:
            raise ValueError(f"infra_retries={infra_retries} must be 0 (no replay) or more")
        self.infra_retries = infra_retries
        if player is not None and (environment_factory is not None or tools or mcp_servers):
            raise ValueError(
                "a player (an agent) runs its own tools and environment: pass player= without "
                "environment_factory or tools (nor mcp_servers)"
            )
        self.multi_environment = isinstance(environment_factory, Mapping)
        factories: dict[str | None, Factory | None]
        if isinstance(environment_factory, Mapping):
            factories = {name: factory for name, factory in environment_factory.items()}
        else:
            factories = {None: environment_factory}
        if not factories:
            raise ValueError("environment_factory is an empty dict; give at least one environment")
        if not self.plays_seats:
            refuse_games(factories.values(), "RolloutEngine")
        processor = tokenizer if is_vision_processor(tokenizer) else None
        if processor is not None:
            tokenizer = processor.tokenizer
        template = load_template(_template_owner(processor, tokenizer), chat_template)
        plain, config = _plain_tools(tools), config or EpisodeConfig()
        self.mcp = McpTools(mcp_servers, config.environment_timeout_s) if mcp_servers else None
        try:  # from here on a failure stops the MCP servers just started
            setup = _Setup(
                backend,
                tokenizer,
                template,
                _with_mcp_tools(plain, self.mcp),
                tool_call_parser,
                chat_template_kwargs,
                config,
                ENVIRONMENT_COLUMN if self.multi_environment else None,
                processor,
            )
            self.contexts = {name: setup.context(factory) for name, factory in factories.items()}
            self.context = next(iter(self.contexts.values()))
            self.row_contexts = RowContexts(setup.play_setup().parser_for)
            self.max_concurrent_episodes = max_concurrent_episodes
            self.player = player(setup.play_setup()) if player is not None else None
        except BaseException:
            if self.mcp is not None:
                self.mcp.close()
            raise

    def context_for(self, row: Mapping[str, Any]) -> EpisodeContext:
        """The context a row's episodes play in: its environment's, with several environments.

        A row with a ``tools`` column (and no player) plays with its own tools beside the
        run's (`rollout.row_tools`).

        Raises:
            ValueError: With several environments, the row names none or an unknown one.
            RowToolsError: The row's ``tools`` or ``max_turns`` column is malformed.
        """
        context = self._environment_context(row)
        return context if self.player is not None else self.row_contexts.context(context, row)

    def _environment_context(self, row: Mapping[str, Any]) -> EpisodeContext:
        if not self.multi_environment:
            return self.context
        name = row.get(ENVIRONMENT_COLUMN)
        if name in self.contexts:
            return self.contexts[name]
        message = (  # TRL's words, which scripts match on
            f"Example has `{ENVIRONMENT_COLUMN}={name!r}`, which is not among the environments "
            f"passed to `environment_factory`. Expected one of: {list(self.contexts)}."
        )
        if ENVIRONMENT_COLUMN not in row:
            message += (
                f" With a dict environment_factory every row names its environment in an "
                f"{ENVIRONMENT_COLUMN!r} column; this row's columns are {sorted(row)}."
            )
        raise ValueError(message)

    async def run(
        self,
        rows: Sequence[Mapping[str, Any]],
        num_generations: int = 1,
        seed: int = 0,
        on_group: Callable[[list[Episode]], Awaitable[None]] | None = None,
    ) -> list[Episode]:
        """Play `num_generations` episodes of each row, all concurrently.

        A row whose `prompt` is a string is rendered as the user's message when the engine has
        tools, and used as raw text (no chat template, TRL's standard format) when it has none.

        Args:
            rows: Task rows (`prompt`, plus the columns the environment's `reset` names).
            num_generations: Episodes per row (the GRPO group size).
            seed: Base seed; group `g` resets with `seed + g`.
            on_group: Awaited with a group's episodes as soon as the last of them ends, while
                other episodes still run (this is where rewards are scored).

        Returns:
            Episodes grouped by row: episode `g * num_generations + k` is the k-th member of
            group `g`, whose members all reset from `rows[g]` with seed `seed + g`.

        """
        contexts = [self.context_for(row) for row in rows]  # every row checked before any plays
        episodes: dict[int, Episode] = {}  # by index; all of them once the task group ends
        limiter = anyio.CapacityLimiter(self.max_concurrent_episodes)
        unfinished = [num_generations] * len(rows)

        async def play(group: int, member: int) -> None:
            index = group * num_generations + member
            async with limiter:
                episodes[index] = await self._play_one(
                    contexts[group], rows[group], seed + group, group, index
                )
            unfinished[group] -= 1
            if unfinished[group] == 0 and on_group is not None:
                start = group * num_generations
                await on_group([episodes[i] for i in range(start, start + num_generations)])

        try:
            async with self._serving(), anyio.create_task_group() as tasks:
                for group in range(len(rows)):
                    for member in range(num_generations):
                        tasks.start_soon(play, group, member)
        except BaseExceptionGroup as failures:
            # One episode's error cancels the rest; the user should see that error, not a group.
            first = _first_error(failures)
        else:
            return [episodes[i] for i in range(len(rows) * num_generations)]
        raise first  # outside the handler: its own __cause__ (the user's error) stays intact

    def _serving(self) -> AbstractAsyncContextManager[None]:
        """The player's endpoint answering while the round plays (nothing without a player)."""
        return self.player.serving() if self.player else contextlib.nullcontext()

    async def _play_one(
        self, ctx: EpisodeContext, row: Mapping[str, Any], seed: int, group: int, index: int
    ) -> Episode:
        """Play one episode; replayed from scratch while an infrastructure failure ends it.

        Each play makes a fresh environment, reset with the same row and seed, and starts the
        per-episode MCP servers afresh (stopped when the play ends, however it ends); past
        `infra_retries` replays the episode is kept as failed (`rollout.infrastructure`).
        """

        async def play() -> Episode:
            if self.player is not None:
                return await self.player.play(row, seed, group, index)
            async with self.mcp.episode() if self.mcp else contextlib.nullcontext():
                return await run_episode(ctx, row, seed, group, index)

        def failed(failure: InfrastructureError) -> Episode:
            token = placeholder_token(ctx.renderer.tokenizer)
            return infra_episode(row, group, index, failure, self.infra_retries, token)

        return await play_retrying(play, self.infra_retries, failed, f"episode {index}")

    def close(self) -> None:
        """Give back what the player holds (an agent endpoint's port) and stop the MCP servers."""
        if self.player is not None:
            self.player.close()
        if self.mcp is not None:
            self.mcp.close()


@dataclass(frozen=True)
class _Setup:
    """What every environment's episode context shares; `context` adds one environment."""

    backend: GenerationBackend
    tokenizer: Any
    template: str
    plain: dict[str, Tool]
    tool_call_parser: str | None
    chat_template_kwargs: Mapping[str, Any] | None
    config: EpisodeConfig
    routing_column: str | None
    processor: Any = None

    def play_setup(self) -> PlaySetup:
        """What a player shares: an agent's requests name their own tools, so parsers follow."""
        return PlaySetup(
            self.backend,
            self.tokenizer,
            self.template,
            lambda schemas: select_parser(
                self.tool_call_parser, self.tokenizer, self.template, schemas
            ),
            self.config,
            self.chat_template_kwargs,
        )

    def context(self, factory: Factory | None) -> EpisodeContext:
        """The context of episodes against `factory`'s environment (or none)."""
        env_class = _environment_class(factory, self.config.environment_timeout_s)
        env_tools = class_tools(env_class) if env_class is not None else {}
        if clash := sorted(self.plain.keys() & env_tools.keys()):
            raise ValueError(f"tools {clash} are both plain tools and environment methods")
        schemas = [t.schema for t in (*self.plain.values(), *env_tools.values())]
        renderer = ChatRenderer(
            self.tokenizer,
            self.template,
            schemas,
            self.chat_template_kwargs,
            processor=self.processor,
        )
        if schemas:
            renderer.check_tool_support()
        return EpisodeContext(
            backend=self.backend,
            renderer=renderer,
            parser=select_parser(self.tool_call_parser, self.tokenizer, self.template, schemas),
            config=self.config,
            tools=self.plain,
            environment_factory=factory,
            environment_tools=env_tools,
            routing_column=self.routing_column,
            context_policy=_context_policy(self.config, env_class, self.backend.context_limit),
        )


def _context_policy(
    config: EpisodeConfig, env_class: type | None, context_limit: int | None
) -> ContextPolicy | None:
    """The config's context policy, else the one the environment class names; checked.

    Raises:
        ContextPolicyError: The class names no policy, or the summary cannot fit the window.
    """
    policy = config.context
    declared = getattr(env_class, "context_policy", None)
    if policy is None and declared is not None:
        if not isinstance(declared, str):
            raise ContextPolicyError(
                f"an environment's context_policy names a policy ({list(POLICY_NAMES)}), not "
                f"{type(declared).__name__}; pass a function as GRPOConfig(context_policy=...)"
            )
        policy = context_policy_of(declared)
    if policy is None or policy.kind == "none":
        return None
    limits = (config.max_completion_length, context_limit, config.max_context)
    policy.check_window(min(limit for limit in limits if limit))
    return policy


def _first_error(group: BaseExceptionGroup) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _template_owner(processor: Any, tokenizer: Any) -> Any:
    """Whose `chat_template` is the default: a VLM processor's, when it has one."""
    return processor if getattr(processor, "chat_template", None) else tokenizer


def _plain_tools(functions: Iterable[Callable[..., Any]]) -> dict[str, Tool]:
    """The plain tools by name; two with one name are an error (the model could call only one).

    A function that carries `check_machine` (`tools.python_tool`'s) has it called once here,
    before any episode: what this machine cannot give it is said, or refused, at start-up.

    Raises:
        ValueError: Two functions share a tool name.
        SandboxUnavailableError: A sandboxed tool cannot isolate code on this machine.
    """
    tools: dict[str, Tool] = {}
    functions = list(functions)
    for check in dict.fromkeys(getattr(f, "check_machine", None) for f in functions):
        if check is not None:
            check()
    for tool in map(as_tool, functions):
        if tool.name in tools:
            raise ValueError(
                f"two tools are named {tool.name!r}: the model could call only one; give each "
                "function its own name (its def, or set its __name__)"
            )
        tools[tool.name] = tool
    return tools


def _with_mcp_tools(plain: dict[str, Tool], mcp: McpTools | None) -> dict[str, Tool]:
    """The plain tools and the MCP servers' tools, by name.

    Raises:
        ValueError: An MCP tool has a plain tool's name (the model could call only one).
    """
    if mcp is None:
        return plain
    if clash := sorted(plain.keys() & mcp.tools.keys()):
        raise ValueError(
            f"tools {clash} are both plain tools and tools of an MCP server (mcp_servers); "
            "rename the function or drop the server"
        )
    return {**plain, **mcp.tools}


def _environment_class(factory: Callable[[], Any] | None, timeout_s: float | None) -> type | None:
    """The environment's class, checked against the contract (None without an environment).

    A class is read without building an instance; any other factory is called once and the
    probe instance closed, each in a daemon thread under `timeout_s` (environment_timeout_s).
    Episodes bind the class's tools (`class_tools`, read once) to their instances.
    """
    if factory is None:
        return None
    cls = factory if isinstance(factory, type) else _probe_class(factory, timeout_s)
    check_environment(cls, factory)
    return cls


def _probe_class(factory: Callable[[], Any], timeout_s: float | None) -> type:
    create = functools.partial(create_environment, factory)
    probe = run_environment_code_blocking(create, init_name(factory), timeout_s)
    close = functools.partial(close_environment, probe)
    run_environment_code_blocking(close, f"{type(probe).__qualname__}.close()", timeout_s)
    return type(probe)


def select_parser(
    name: str | None, tokenizer: Any, template: str, schemas: Sequence[Mapping[str, Any]]
) -> Parser:
    """The parser a run reads tool calls with (`tool_call_parser` in `RolloutEngine`).

    No tools: every turn is a plain answer. A name: that parser. None: the tokenizer's response
    parser if it has one, else the one `detect_parser` finds in the template.

    Raises:
        ValueError: An unknown name, or a template whose tool format cannot be told.

    """
    if not schemas:
        return _no_tool_calls
    if name is not None:
        return get_parser(name, tools=schemas)
    detected = tokenizer_parser(tokenizer, tools=schemas)
    return detected or get_parser(detect_parser(template), tools=schemas)


def _no_tool_calls(text: str) -> ParsedTurn:
    """With no tools offered, every turn is a plain answer."""
    return ParsedTurn(text)
