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
import json
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
    gives_turn_rewards,
    init_name,
    read_done,
    read_reward,
    reset_environment,
    respond_text,
    responds,
    run_environment_code,
    state_key_text,
    tool_method,
    turn_reward_value,
)
from rollout.backend import GenerationBackend
from rollout.compaction import ContextPolicy, compact
from rollout.parsers import Parser
from rollout.prompts import row_messages, show_row, with_observation
from rollout.template import ChatRenderer, images_of
from rollout.tokens import EpisodeState, TokenRow
from rollout.tool_calls import assistant_message, call_records, run_calls, tool_message
from rollout.types import (
    Completion,
    Episode,
    EpisodeStats,
    Finish,
    ParsedTurn,
    SamplingParams,
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
        max_context: The most tokens a row may hold, prompt included (None: the model's
            context limit only).
        context: What an episode does when its context nears the window (`rollout.compaction`;
            None: nothing, the episode ends with LENGTH when the budget runs out). An
            environment class may name a policy (``context_policy = "truncate"``) for its own
            episodes, used with the default settings when this is None.
        turn_states: Log the state each turn starts from (`TurnRecord.state`), for
            ``turn_advantage="same_state"``.

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
    max_context: int | None = None
    context: ContextPolicy | None = None
    turn_states: bool = False

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
    context_policy: ContextPolicy | None = None  # the config's, else the environment's

    def window(self, first_prompt_length: int) -> int:
        """The most tokens a row may hold: the budget, the context and `max_context`."""
        limits = (
            first_prompt_length + self.config.max_completion_length,
            self.backend.context_limit,
            self.config.max_context,
        )
        return min(limit for limit in limits if limit)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, as the tokenizer decodes it."""
        return self.renderer.tokenizer.decode(ids)

    @property
    def has_tools(self) -> bool:
        """Whether episodes offer tools (plain ones or an environment's)."""
        return bool(self.tools) or self.environment_factory is not None


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
    messages = row_messages(row)
    timeout_s = ctx.config.environment_timeout_s
    env, observation = None, None
    if ctx.environment_factory is not None:
        env, observation = await _create_and_reset(
            ctx.environment_factory, _reset_row(ctx, row), seed, timeout_s
        )
    try:
        if env is not None:
            messages = with_observation(messages, observation)
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
        stats=EpisodeStats(
            state.turns,
            state.tool_calls,
            dict(state.tool_errors),
            tuple(state.compactions),
            state.responses,
        ),
        row=row,
        group=group,
        index=index,
        env_reward=reward,
        environment=env,
        error=state.error,
        tool_calls=tuple(state.calls),
        turns=tuple(state.turn_log),
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


def _bind(tools: Mapping[str, Tool], env: Any) -> dict[str, Tool]:
    """The class's tools, calling this episode's instance (after its ``reset``).

    Raises:
        EnvironmentSpecError: An instance attribute hides one of them (`tool_method`).
    """
    return {name: dataclasses.replace(t, fn=tool_method(env, name)) for name, t in tools.items()}


def _start(
    ctx: EpisodeContext, messages: list[dict[str, Any]], row: Mapping, sample_seed: int
) -> EpisodeState:
    try:
        images = images_of(messages)
    except ValueError as error:  # an image part without an image, or one it cannot show
        raise ValueError(f"{error}. Row: {show_row(row)}") from None
    vision: dict[str, Any] = {}
    if isinstance(row.get("prompt"), str) and not ctx.has_tools and not images:
        # TRL's standard format: the text itself, tokenized as is, with no chat template.
        prompt_text = row["prompt"]
        prompt_ids = ctx.renderer.tokenizer.encode(prompt_text)
    else:
        fresh = ctx.renderer.fresh(messages)
        prompt_text, prompt_ids, vision = fresh.prompt_text, fresh.ids, dict(fresh.vision)
    limit = ctx.config.max_prompt_length
    context = ctx.backend.context_limit
    if (limit and len(prompt_ids) > limit) or (context and len(prompt_ids) >= context):
        raise PromptTooLongError(
            f"The prompt of this row is {len(prompt_ids)} tokens, over the limit "
            f"(max_prompt_length={limit}, model context={context}). Shorten the prompt or raise "
            f"the limit. Row: {show_row(row)}"
        )
    if images and not ctx.backend.reads_images:
        raise ValueError(
            f"this row holds images but the generation backend ({type(ctx.backend).__name__}) "
            "cannot read them; generate with transformers (use_vllm=False), or with vLLM "
            "(colocated or a server) given the model's processor"
        )
    return EpisodeState(messages, TokenRow(prompt_ids, images, vision), prompt_text, sample_seed)


async def _play(
    ctx: EpisodeContext, state: EpisodeState, tools: Mapping[str, Tool], env: Any
) -> Finish:
    """The turn loop; returns why the episode ended.

    A turn's reward is what its tool calls' `Rewarded` results gave, plus the environment's
    ``turn_reward()``, read once the turn's calls ran.
    """
    window = ctx.window(state.first_prompt_length)
    while True:
        if finish := await _compact_if_full(ctx, state, window):
            return finish
        budget = window - len(state.tokens.context_ids)  # within max_completion_length too
        if budget < 1:
            return Finish.LENGTH
        finish = await _turn(ctx, state, tools, env, budget)
        state.score_turn(await _turn_reward(ctx, env))
        if finish:
            return finish


async def _turn_reward(ctx: EpisodeContext, env: Any) -> float:
    """The environment's ``turn_reward()``, run like its other methods; 0.0 without one."""
    if env is None or not gives_turn_rewards(type(env)):
        return 0.0
    where = f"{type(env).__qualname__}.turn_reward()"
    score = functools.partial(turn_reward_value, env)
    return await run_environment_code(score, where, ctx.config.environment_timeout_s)


async def _turn(
    ctx: EpisodeContext, state: EpisodeState, tools: Mapping[str, Tool], env: Any, budget: int
) -> Finish | None:
    """One model turn and its tool calls; returns a Finish if the episode ends here."""
    turn_seed = hash((state.sample_seed, state.turns)) % 2**62
    params = ctx.config.sampling(budget, turn_seed)
    key = await _state_key(ctx, state, env) if ctx.config.turn_states else None
    completion = await ctx.backend.generate(state.tokens.context_ids, params, state.tokens.pictures)
    state.add_sampled(completion, key)
    state.turns += 1
    decode = ctx.decode
    if not completion.stopped:
        state.messages.append({"role": "assistant", "content": decode(completion.token_ids)})
        return Finish.LENGTH
    text = decode(completion.token_ids[:-1])
    parsed = ctx.parser(text)
    state.messages.append(assistant_message(text, parsed))
    stop_text = decode(completion.token_ids[-1:])
    if not parsed.tool_calls and not parsed.errors:
        return await _reply(ctx, state, env, text, stop_text)
    if ctx.config.max_tool_rounds is not None and state.turns > ctx.config.max_tool_rounds:
        return Finish.MAX_TURNS  # every earlier turn ran its calls: no more may run
    results = await run_calls(parsed.tool_calls, tools, ctx.tools.keys(), ctx.config.tool_timeout_s)
    _count(state, parsed, results)
    tool_messages = [tool_message(r.name, r.content, r.images) for r in results]
    tool_messages += [tool_message("error", e) for e in parsed.errors]
    env_done = env is not None and await read_done(env, ctx.config.environment_timeout_s)
    finish = _add_follow_up(ctx, state, tool_messages, stop_text, env_done)
    shown = state.messages[len(state.messages) - len(tool_messages) :]
    state.calls.extend(call_records(parsed, results, shown))
    return finish


async def _reply(
    ctx: EpisodeContext, state: EpisodeState, env: Any, text: str, stop_text: str
) -> Finish | None:
    """After a turn without tool calls: STOP, or the environment's reply as the next user turn.

    An environment with ``respond`` (`environments.replies`) gets the turn's text; the text it
    returns is added like tool results are (cut to the budget, appended with mask 0), and
    None ends the episode.
    """
    if env is None or not responds(type(env)):
        return Finish.STOP
    where = f"{type(env).__qualname__}.respond()"
    respond = functools.partial(respond_text, env, text)
    reply = await run_environment_code(respond, where, ctx.config.environment_timeout_s)
    if reply is None:
        return Finish.STOP
    state.responses += 1
    env_done = await read_done(env, ctx.config.environment_timeout_s)
    return _add_follow_up(ctx, state, [{"role": "user", "content": reply}], stop_text, env_done)


async def _compact_if_full(ctx: EpisodeContext, state: EpisodeState, window: int) -> Finish | None:
    """Compact the context once it passes the policy's threshold of `window` (`compact`)."""
    policy = ctx.context_policy
    if policy is None or len(state.tokens.context_ids) <= policy.threshold * window:
        return None
    if state.compactions and state.compactions[-1].turn == state.turns:
        return None  # once a turn: a context the policy cannot bring under it runs out instead

    async def generate(max_tokens: int, seed: int) -> Completion:
        params = ctx.config.sampling(max_tokens, seed)
        return await ctx.backend.generate(state.tokens.context_ids, params, state.tokens.pictures)

    return await compact(state, policy, window, ctx.renderer, generate)


async def _state_key(ctx: EpisodeContext, state: EpisodeState, env: Any) -> str:
    """The state a turn starts from: the environment's ``state_key``, else its observation.

    The observation is what the model saw since its last turn (the task, tool results, a
    reply), as JSON.

    Raises:
        ValueError: The observation holds something JSON cannot write (an image), so turns
            cannot be compared without a ``state_key`` method.
    """
    if env is not None and callable(getattr(type(env), "state_key", None)):
        where = f"{type(env).__qualname__}.state_key()"
        key = functools.partial(state_key_text, env)
        return await run_environment_code(key, where, ctx.config.environment_timeout_s)
    messages = state.context_messages
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    try:
        return json.dumps(messages[last + 1 :], sort_keys=True)
    except TypeError:
        raise ValueError(
            'turn_advantage="same_state" compares turns by their observations as JSON, and '
            "this one holds something else (an image?): give the environment a "
            "`state_key(self) -> str` method, or use turn_advantage 'return' or 'episode'"
        ) from None


def _add_follow_up(
    ctx: EpisodeContext,
    state: EpisodeState,
    tool_messages: list[dict],
    stop_text: str,
    env_done: bool,
) -> Finish | None:
    """Record tool results (or a reply); append their tokens (mask 0) unless the episode ends.

    A result too long to fit the budget left is cut first (`ChatRenderer.fitted_tool_turn`),
    so it is never tokenized (nor recorded, nor logged) in full; the episode ends with LENGTH
    all the same, and its messages hold the cut text. When it ends here (ENV_DONE, MAX_TURNS),
    nothing is tokenized, and the messages hold the results cut as the next turn would have
    shown them.
    """
    ends = _ending(ctx, state, env_done)
    left = ctx.config.max_completion_length - state.spent
    cut = ctx.renderer.fit_tool_messages(tool_messages, left)  # as an ending shows them
    if ends is not None:
        state.messages.extend(cut)
        return ends
    try:
        shown, turn = ctx.renderer.fitted_tool_turn(
            state.prompt_text,
            state.context_messages,
            tool_messages,
            stop_text,
            (left, ctx.config.max_completion_length),
        )
    except jinja2.TemplateError as error:  # the template cannot render what the model wrote
        state.messages.extend(cut)
        state.error = f"the chat template could not render this turn: {error}"
        return Finish.ERROR
    state.messages.extend(shown)
    context = len(turn.ids) if turn.fork else len(state.tokens.context_ids) + len(turn.ids)
    if context >= ctx.window(state.first_prompt_length):  # no room left for a model turn
        return Finish.LENGTH
    state.add_tool_turn(turn)
    return None


def _ending(ctx: EpisodeContext, state: EpisodeState, env_done: bool) -> Finish | None:
    """ENV_DONE or MAX_TURNS when the episode ends after this turn's tool results, else None."""
    if env_done:
        return Finish.ENV_DONE
    if state.turns >= ctx.config.max_turns:
        return Finish.MAX_TURNS
    return None


def _count(state: EpisodeState, parsed: ParsedTurn, results: list[ToolResult]) -> None:
    """Count a turn's calls and their errors, and keep what their `Rewarded` results gave."""
    state.tool_calls += len(parsed.tool_calls) + len(parsed.errors)
    state.tool_reward += sum(r.reward for r in results)
    state.tool_errors.update(str(r.error) for r in results if r.error is not None)
    if parsed.errors:
        state.tool_errors["parse"] += len(parsed.errors)
