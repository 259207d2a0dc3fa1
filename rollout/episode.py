"""One episode: generate, parse tool calls, run them, append the tool turn, until it ends.

The loop only appends tokens (see `rollout.template`): the model's turn as sampled (mask 1), then
the template's tool turn (mask 0). Where the template rewrites the conversation once a tool turn is
added, the episode forks: the current row is closed and a new one starts from the template's
fresh rendering (its prompt, mask 0), so every sampled token is trained in the context it was
sampled in. Failures the model causes (unparseable calls, unknown tools,
bad arguments, tools that raise or time out) become tool messages it can read, and are counted.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jinja2

from environments import (
    EnvironmentTimeoutError,
    add_close_note,
    close_after_failure,
    close_environment,
    create_environment,
    init_name,
    read_done,
    read_reward,
    reset_environment,
    run_environment_code,
    tool_method,
)
from rollout.backend import GenerationBackend
from rollout.images import (
    images_of,
    with_observation_parts,
    with_row_images,
)
from rollout.parsers import Parser
from rollout.template import ChatRenderer, ToolTurn
from rollout.tokens import TokenRow
from rollout.tool_calls import assistant_message, call_records, run_calls, tool_message
from rollout.types import (
    Completion,
    Episode,
    EpisodeRow,
    EpisodeStats,
    Finish,
    ParsedTurn,
    SamplingParams,
    ToolCallRecord,
)
from tools import Tool, ToolResult
from tools.threads import shield_unless_interrupted


class PromptTooLongError(ValueError):
    """A task's prompt leaves no room to generate within the context or the prompt limit."""


@dataclass(frozen=True)
class EpisodeConfig:
    """Limits and sampling shared by every episode of a run.

    Attributes:
        max_completion_length: Budget of completion tokens per episode, tool turns included.
        max_turns: The most model turns per episode. The calls of the last turn still run (a
            final ``submit``), and the episode ends after them (MAX_TURNS).
        max_tool_rounds: The most turns whose tool calls run (TRL's
            ``max_tool_calling_iterations``): a later turn that calls tools ends the episode
            there (MAX_TURNS) without running them, so its messages end with that call. None:
            only `max_turns` limits them.
        max_prompt_length: The most prompt tokens (None: only the context limit applies).
        tool_timeout_s: Per-call tool timeout (None: no timeout).
        environment_timeout_s: Seconds each of the environment's ``__init__``, ``reset``,
            ``done`` (a property), ``reward`` and ``close`` may take before the run stops with an
            `EnvironmentTimeoutError` naming the method (None: no timeout).
        temperature, top_p, top_k: Sampling, as in `SamplingParams`.

    """

    max_completion_length: int = 256
    max_turns: int = 10
    max_tool_rounds: int | None = None
    max_prompt_length: int | None = None
    tool_timeout_s: float | None = 30.0
    environment_timeout_s: float | None = 120.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def sampling(self, max_tokens: int, seed: int | None) -> SamplingParams:
        """Sampling parameters for one turn with `max_tokens` left."""
        return SamplingParams(max_tokens, self.temperature, self.top_p, self.top_k, seed)


@dataclass
class EpisodeContext:
    """What every episode of a run shares: the generator, renderer, parser and tools."""

    backend: GenerationBackend
    renderer: ChatRenderer
    parser: Parser
    config: EpisodeConfig
    tools: Mapping[str, Tool] = field(default_factory=dict)
    environment_factory: Callable[[], Any] | None = None
    environment_tools: Mapping[str, Tool] = field(default_factory=dict)
    # The row column that chose this environment (several environments): not passed to reset.
    routing_column: str | None = None

    @property
    def has_tools(self) -> bool:
        """Whether episodes offer tools (plain ones or an environment's)."""
        return bool(self.tools) or self.environment_factory is not None


@dataclass
class _State:
    """An episode in play. `tokens` is the current row; `done_rows` the rows closed by forks."""

    messages: list[dict[str, Any]]
    tokens: TokenRow
    prompt_text: str
    sample_seed: int
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Tally = field(default_factory=Tally)
    error: str | None = None
    calls: list[ToolCallRecord] = field(default_factory=list)
    done_rows: list[EpisodeRow] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.first_prompt_length = len(self.tokens.prompt_ids)

    @property
    def spent(self) -> int:
        """Tokens past the task's prompt, as the current row renders the conversation.

        `max_completion_length` bounds this. For a row that never forked it is the row's
        completion length; after a fork it counts the fresh rendering's part past the prompt.
        """
        return len(self.tokens.context_ids) - self.first_prompt_length

    def add_tool_turn(self, turn: ToolTurn) -> None:
        """Append the tool turn to the current row, or close the row and start a new one."""
        self.prompt_text = turn.prompt_text
        if not turn.fork:
            self.tokens.append_context(turn.ids, turn.images, turn.vision)
            return
        self.done_rows.append(_row(self.tokens))
        self.tokens = TokenRow(turn.ids, turn.images, turn.vision)

    def rows(self) -> tuple[EpisodeRow, ...]:
        """Every row of the episode, the current one last."""
        return (*self.done_rows, _row(self.tokens))


def _row(tokens: TokenRow) -> EpisodeRow:
    versions = tokens.versions if tokens.versions and 1 in tokens.loss_mask else None
    return EpisodeRow(
        tokens.prompt_ids,
        tokens.completion_ids,
        tokens.loss_mask,
        tokens.logprobs,
        tuple(tokens.images),
        tokens.vision_inputs,
        policy_versions=versions,
    )


async def run_episode(
    ctx: EpisodeContext, row: Mapping[str, Any], seed: int, group: int, index: int
) -> Episode:
    """Play one episode of `row` against a fresh environment, which is always closed.

    `seed` is the group's: the environment resets with it, and each turn samples with a seed
    derived from it, the episode's `index` and the turn, so an episode is reproducible however
    its requests are batched with others.

    The environment's own code (constructor, `reset`, `reward`, `close`) runs in a daemon
    thread, like sync tools (`tools.run_in_daemon_thread`), so a slow environment never stalls
    the other episodes and one that never returns cannot keep the process alive; past
    `environment_timeout_s` it is abandoned and the run stops with an `EnvironmentTimeoutError`.
    ``done``, when a property, runs there too. When the episode fails, its first error is the
    one raised: a `close` that fails (or times out) too becomes a note on it; after a method
    that timed out, `close` is not called (see `_close`).
    """
    messages = _row_messages(row)
    timeout_s = ctx.config.environment_timeout_s
    env, observation = None, None
    if ctx.environment_factory is not None:
        env, observation = await _create_and_reset(
            ctx.environment_factory, _reset_row(ctx, row), seed, timeout_s
        )
    try:
        if env is not None:
            messages = _with_observation(messages, observation)
        if not messages:
            raise ValueError(f"a task row needs a 'prompt' column; this one has {sorted(row)}")
        tools = {**ctx.tools, **_bind(ctx.environment_tools, env)}
        state = _start(ctx, messages, row, sample_seed=hash((seed, index)))
        finish = await _play(ctx, state, tools, env)
        reward = await read_reward(env, timeout_s) if env is not None else None
    except BaseException as failure:
        if env is not None:
            await _close(env, timeout_s, failure)
        raise
    if env is not None:
        await _close(env, timeout_s)
    return Episode(
        rows=state.rows(),
        messages=state.messages,
        finish=finish,
        stats=EpisodeStats(state.turns, state.tool_calls, dict(state.tool_errors)),
        row=row,
        group=group,
        index=index,
        env_reward=reward,
        environment=env,
        error=state.error,
        tool_calls=tuple(state.calls),
    )


def _reset_row(ctx: EpisodeContext, row: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row's columns `reset` may receive: all but the one that chose the environment."""
    if ctx.routing_column is None:
        return row
    return {key: value for key, value in row.items() if key != ctx.routing_column}


async def _create_and_reset(
    factory: Callable[[], Any], row: Mapping[str, Any], seed: int, timeout_s: float | None
) -> tuple[Any, str | list[Any] | None]:
    """Make and reset an environment, each in a daemon thread; close it if `reset` fails."""
    env = await run_environment_code(
        functools.partial(create_environment, factory), init_name(factory), timeout_s
    )
    where = f"{type(env).__qualname__}.reset()"
    try:
        reset = functools.partial(reset_environment, env, row, seed)
        return env, await run_environment_code(reset, where, timeout_s)
    except BaseException as failure:
        await _close(env, timeout_s, failure)
        raise


async def _close(env: Any, timeout_s: float | None, failure: BaseException | None = None) -> None:
    """Close `env` in a daemon thread, even while cancelled (but not by Ctrl-C).

    After `failure`, a close that fails or times out too is a note on `failure`, which the
    caller raises. After a method of `env` timed out and still runs (`failure` is an
    `EnvironmentTimeoutError`), `close` is not called, and a note on `failure` says so: the
    contract runs one method of an instance at a time, and closing under a running ``reset``
    or ``reward`` could break it in ways that hide the timeout. The run stops on that error.
    """
    where = f"{type(env).__qualname__}.close()"
    if isinstance(failure, EnvironmentTimeoutError) and failure.still_running:
        failure.add_note(f"{where} was not called: the method that timed out may still run.")
        return
    if failure is None:
        close = functools.partial(close_environment, env)
    else:
        close = functools.partial(close_after_failure, env, failure)
    with shield_unless_interrupted():
        try:
            await run_environment_code(close, where, timeout_s)
        except EnvironmentTimeoutError as timeout:
            if failure is None:
                raise
            add_close_note(failure, timeout)


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation a row starts with: its `prompt`, a string or a list of messages."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [dict(m) for m in prompt]
    if not messages or messages[-1].get("role") != "user":
        raise ValueError(f"a conversational prompt must end with a user message: {prompt!r}")
    return messages


def _with_observation(
    messages: list[dict[str, Any]], observation: str | list[Any] | None
) -> list[dict[str, Any]]:
    """Add reset's text: on a new line of the last user message, or as the prompt itself.

    A row without a `prompt` column leaves the environment to state the task (TRL's
    environment-owned data): its text is the user's message, and when `reset` returns None
    the message is empty, as in TRL (the environment's tools and the template still frame
    the task). A list (texts and images, for a vision-language model) is added as content
    parts, in order (`rollout.images.with_observation_parts`), and so is a text when the last
    user message's content is already parts (its images kept).
    """
    if isinstance(observation, list):
        return with_observation_parts(messages, observation)
    if observation and messages and isinstance(messages[-1].get("content"), list):
        return with_observation_parts(messages, [observation])
    if not messages:
        return [{"role": "user", "content": observation or ""}]
    if not observation:
        return messages
    content = messages[-1].get("content") or ""
    last = {**messages[-1], "content": f"{content}\n{observation}" if content else observation}
    return [*messages[:-1], last]


def _bind(tools: Mapping[str, Tool], env: Any) -> dict[str, Tool]:
    """The class's tools, calling this episode's instance (after its ``reset``).

    Raises:
        EnvironmentSpecError: An instance attribute hides one of them (`tool_method`).
    """
    return {name: dataclasses.replace(t, fn=tool_method(env, name)) for name, t in tools.items()}


def _start(
    ctx: EpisodeContext, messages: list[dict[str, Any]], row: Mapping, sample_seed: int
) -> _State:
    try:
        images = images_of(messages)
    except ValueError as error:  # an image part without an image, or one it cannot show
        raise ValueError(f"{error}. Row: {_show(row)}") from None
    vision: dict[str, Any] = {}
    if isinstance(row.get("prompt"), str) and not ctx.has_tools and not images:
        # TRL's standard format: the text itself, tokenized as is, with no chat template.
        prompt_text = row["prompt"]
        prompt_ids = ctx.renderer.tokenizer.encode(prompt_text)
    else:
        prompt_text = ctx.renderer.render(messages, generation_prompt=True)
        prompt_ids, vision, _ = ctx.renderer.encode_messages(prompt_text, messages)
    limit = ctx.config.max_prompt_length
    context = ctx.backend.context_limit
    if (limit and len(prompt_ids) > limit) or (context and len(prompt_ids) >= context):
        raise PromptTooLongError(
            f"The prompt of this row is {len(prompt_ids)} tokens, over the limit "
            f"(max_prompt_length={limit}, model context={context}). Shorten the prompt or raise "
            f"the limit. Row: {_show(row)}"
        )
    if images and not ctx.backend.reads_images:
        raise ValueError(
            f"this row holds images but the generation backend ({type(ctx.backend).__name__}) "
            "cannot read them; generate with transformers (use_vllm=False), or with vLLM "
            "(colocated or a server) given the model's processor"
        )
    return _State(messages, TokenRow(prompt_ids, images, vision), prompt_text, sample_seed)


async def _play(ctx: EpisodeContext, state: _State, tools: Mapping[str, Tool], env: Any) -> Finish:
    """The turn loop; returns why the episode ended."""
    while True:
        budget = ctx.config.max_completion_length - state.spent
        if ctx.backend.context_limit:
            budget = min(budget, ctx.backend.context_limit - len(state.tokens.context_ids))
        if budget < 1:
            return Finish.LENGTH
        if finish := await _turn(ctx, state, tools, env, budget):
            return finish


async def _turn(
    ctx: EpisodeContext, state: _State, tools: Mapping[str, Tool], env: Any, budget: int
) -> Finish | None:
    """One model turn and its tool calls; returns a Finish if the episode ends here."""
    turn_seed = hash((state.sample_seed, state.turns)) % 2**62
    params = ctx.config.sampling(budget, turn_seed)
    completion = await _generate(ctx.backend, state.tokens, params)
    state.tokens.append_sampled(completion.token_ids, completion.logprobs, completion.versions)
    state.turns += 1
    decode = ctx.renderer.tokenizer.decode
    if not completion.stopped:
        state.messages.append({"role": "assistant", "content": decode(completion.token_ids)})
        return Finish.LENGTH
    text = decode(completion.token_ids[:-1])
    parsed = ctx.parser(text)
    state.messages.append(assistant_message(text, parsed))
    if not parsed.tool_calls and not parsed.errors:
        return Finish.STOP
    if ctx.config.max_tool_rounds is not None and state.turns > ctx.config.max_tool_rounds:
        return Finish.MAX_TURNS  # every earlier turn ran its calls: no more may run
    results = await run_calls(parsed.tool_calls, tools, ctx.tools.keys(), ctx.config.tool_timeout_s)
    _count(state, parsed, results)
    tool_messages = [tool_message(r.name, r.content, r.images) for r in results]
    tool_messages += [tool_message("error", e) for e in parsed.errors]
    env_done = env is not None and await read_done(env, ctx.config.environment_timeout_s)
    stop_text = decode(completion.token_ids[-1:])
    finish = _add_tool_turn(ctx, state, tool_messages, stop_text, env_done)
    shown = state.messages[len(state.messages) - len(tool_messages) :]
    state.calls.extend(call_records(parsed, results, shown))
    return finish


async def _generate(
    backend: GenerationBackend, tokens: TokenRow, params: SamplingParams
) -> Completion:
    """The model's next turn, with the row's pictures when it holds any."""
    pictures = tokens.pictures
    if pictures is None:
        return await backend.generate(tokens.context_ids, params)
    return await backend.generate(tokens.context_ids, params, pictures)


def _add_tool_turn(
    ctx: EpisodeContext, state: _State, tool_messages: list[dict], stop_text: str, env_done: bool
) -> Finish | None:
    """Record the tool results; append their tokens (mask 0) unless the episode ends here.

    A result too long to fit the budget left is cut first (`ChatRenderer.fit_tool_messages`),
    so it is never tokenized (nor recorded, nor logged) in full; the episode ends with LENGTH
    all the same, and its messages hold the cut text. When it ends here (ENV_DONE, MAX_TURNS),
    nothing is tokenized, and the messages hold the results cut as the next turn would have
    shown them.
    """
    history = list(state.messages)
    ends = _ending(ctx, state, env_done)
    fitted = ctx.renderer.fit_tool_messages(
        tool_messages, ctx.config.max_completion_length - state.spent
    )
    if ends is not None:
        state.messages.extend(fitted)
        return ends
    try:
        tool_messages, turn = _tool_turn(ctx, state, history, tool_messages, fitted, stop_text)
    except jinja2.TemplateError as error:  # the template cannot render what the model wrote
        state.messages.extend(fitted)
        state.error = f"the chat template could not render this turn: {error}"
        return Finish.ERROR
    state.messages.extend(tool_messages)
    context = len(turn.ids) if turn.fork else len(state.tokens.context_ids) + len(turn.ids)
    if context - state.first_prompt_length >= ctx.config.max_completion_length:
        return Finish.LENGTH
    state.add_tool_turn(turn)
    return None


def _tool_turn(
    ctx: EpisodeContext,
    state: _State,
    history: list[dict],
    tool_messages: list[dict],
    fitted: list[dict],
    stop: str,
) -> tuple[list[dict], ToolTurn]:
    """The tool messages cut to the budget left (`fitted`), and the tool turn they make.

    A fork can drop history (past reasoning), leaving more room than the current row has, so a
    turn that forks with a cut result is redone with results cut only at the whole budget.
    """
    turn = ctx.renderer.tool_turn(state.prompt_text, history, fitted, stop)
    if turn.fork and fitted != tool_messages:
        fitted = ctx.renderer.fit_tool_messages(tool_messages, ctx.config.max_completion_length)
        turn = ctx.renderer.tool_turn(state.prompt_text, history, fitted, stop)
    return fitted, turn


def _ending(ctx: EpisodeContext, state: _State, env_done: bool) -> Finish | None:
    """ENV_DONE or MAX_TURNS when the episode ends after this turn's tool results, else None."""
    if env_done:
        return Finish.ENV_DONE
    if state.turns >= ctx.config.max_turns:
        return Finish.MAX_TURNS
    return None


def _count(state: _State, parsed: ParsedTurn, results: list[ToolResult]) -> None:
    """Count a turn's calls and their errors."""
    state.tool_calls += len(parsed.tool_calls) + len(parsed.errors)
    state.tool_errors.update(str(r.error) for r in results if r.error is not None)
    if parsed.errors:
        state.tool_errors["parse"] += len(parsed.errors)


def _row_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The row's prompt messages with its images (`with_row_images`); none without a prompt.

    Raises:
        ValueError: The row's images do not fit its prompt, or cannot be shown, naming the row.
    """
    if "prompt" not in row:
        return []
    try:
        return with_row_images(prompt_messages(row), row)
    except ValueError as error:
        raise ValueError(f"{error}. Row: {_show(row)}") from None


def _show(row: Mapping[str, Any], width: int = 200) -> str:
    text = repr(dict(row))
    return text if len(text) <= width else text[: width - 3] + "..."
