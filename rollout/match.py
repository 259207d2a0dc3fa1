"""Matches: a game with seats (`environments.seats`) played by several players, one episode a seat.

One environment instance holds the game. The seat it names (``to_move``) plays the next turn:
a scripted player (`environments.seats.ScriptedPlayer`) calls the game's tools itself; a seat
a model plays (the policy, or a frozen snapshot of it: `environments.seats.Snapshot`) samples
a turn in its own conversation from its own backend, and its tool calls run on the game.
Each model seat's conversation is its own: the row's prompt with ``reset``'s text and, at its
first turn, what ``observe(seat)`` tells it; at each later turn its own last tool results, then
``observe(seat)`` (the other seats' moves) as a user message, appended as one mask-0 delta
through the chat template, as an episode appends a tool turn (`rollout.episode`). So every
model seat gets token-exact rows, and the match gives one `Episode` per policy seat (a
snapshot's side is not trained, and not returned), each with that seat's reward
(``reward(seat)``).

A model seat's turn that makes no tool call forfeits the game: it ends there, that seat gets
`ILLEGAL_MOVE_REWARD` and the other seats 0.0. A seat that runs out of tokens or turns cuts
the game off for every seat (LENGTH or MAX_TURNS); the rewards are then the game's, unless
that seat wasted a turn (one cut off mid-text, or whose every tool call failed): then it
forfeits, so stalling a lost game with broken calls never earns the unfinished game's 0. A policy
seat whose game ended before its first turn sampled nothing: its episode `sat_out`, and the
round leaves it out of its group's baseline and of training, as an infrastructure failure.
`MatchEngine` plays a round of matches in place of `RolloutEngine`'s episodes, with groups
formed per (row, seat).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from environments import (
    close_after_failure,
    close_environment,
    create_environment,
    init_name,
    reset_environment,
    run_environment_code,
    tool_method,
)
from environments.seats import (
    ILLEGAL_MOVE_REWARD,
    SeatPlayer,
    Snapshot,
    is_seated,
    seat_observation,
    seat_players,
    seat_reward,
    seat_to_move,
    seats_of,
)
from rollout.backend import GenerationBackend
from rollout.engine import RolloutEngine
from rollout.episode import EpisodeContext, PromptTooLongError
from rollout.prompts import row_messages, show_row, with_observation
from rollout.tokens import EpisodeState, TokenRow
from rollout.tool_calls import assistant_message, call_records, run_calls, tool_message
from rollout.types import Episode, EpisodeStats, Finish
from tools import Tool

#: The row column that names the seat an episode played (added to `Episode.row`).
SEAT_COLUMN = "seat"


def sat_out(episode: Episode) -> bool:
    """Whether `episode` is a game's seat that sampled nothing (the game ended before its turn).

    Its reward is the game's for moves it never made: it says nothing about the policy, so a
    round scores it as it does an infrastructure failure (`Finish.INFRA`): not at all.
    """
    sampled = any(mask for row in episode.rows for mask in row.loss_mask)
    return not sampled and is_seated(type(episode.environment))


@dataclass
class _Seat:
    """A model seat's side of a match: its conversation and rows, once it has played.

    Attributes:
        backend: What samples its turns: the policy's backend, or its snapshot's.
        trained: The policy plays it (its episode is returned); False for a snapshot.
        temperature: Its own sampling temperature (a snapshot's); None: the run's.
    """

    name: str
    backend: GenerationBackend
    trained: bool
    temperature: float | None = None
    state: EpisodeState | None = None
    pending: list[dict[str, Any]] = field(default_factory=list)  # its last turn's results
    stop_text: str = ""
    finish: Finish | None = None
    wasted_turns: int = 0  # turns that made no move: cut off mid-text, or every call failed


@dataclass
class _Match:
    """One match in play."""

    ctx: EpisodeContext
    env: Any
    row: Mapping[str, Any]
    prompt: list[dict[str, Any]]
    players: Mapping[str, SeatPlayer]
    sample_seed: int
    sides: dict[str, _Seat]
    forfeit: str | None = None

    async def env_code(self, fn: Callable[[], Any], what: str) -> Any:
        """Run the game's own code in a daemon thread under `environment_timeout_s`."""
        where = f"{type(self.env).__qualname__}.{what}"
        return await run_environment_code(fn, where, self.ctx.config.environment_timeout_s)


async def play_match(
    ctx: EpisodeContext,
    row: Mapping[str, Any],
    seed: int,
    players: Mapping[str, SeatPlayer],
    place: Callable[[str], tuple[int, int]],
    snapshots: Mapping[str, Sequence[GenerationBackend]],
    temperatures: Mapping[str, float] | None = None,
) -> dict[str, Episode]:
    """Play one match of `row`; return the episode of each policy seat (None in `players`).

    Args:
        ctx: The engine's context of the game (renderer, parser, backend, limits, tools).
        row: The task row; `reset` receives its columns.
        seed: The group's seed: the game resets with it; turns sample from it and the seat.
        players: Every seat's player: None for the policy, a `Snapshot` or a scripted player.
        place: A policy seat's (group, index) in the round.
        snapshots: The backends of each seat a `Snapshot` plays: the match draws one from its
            seed (a league's pool holds several).
        temperatures: The sampling temperature of `Snapshot` seats that have their own
            (None or left out: the run's).

    Raises:
        PromptTooLongError: A seat's first prompt leaves no room to generate.
    """
    assert ctx.environment_factory is not None
    factory, timeout_s = ctx.environment_factory, ctx.config.environment_timeout_s
    first = next(seat for seat, player in players.items() if player is None)
    sample_seed = hash((seed, *place(first)))
    sides = {
        seat: _Seat(
            seat,
            _drawn(snapshots, seat, sample_seed, players) if seat in snapshots else ctx.backend,
            player is None,
            (temperatures or {}).get(seat),
        )
        for seat, player in players.items()
        if player is None or isinstance(player, Snapshot)
    }
    create = functools.partial(create_environment, factory)
    env = await run_environment_code(create, init_name(factory), timeout_s)
    match = _Match(ctx, env, row, [], players, sample_seed, sides)
    try:
        reset = functools.partial(reset_environment, env, row, seed)
        shared = await match.env_code(reset, "reset()")
        match.prompt = with_observation(row_messages(row), shared)
        finish = await _play(match)
        rewards = await _rewards(match)
        for side in sides.values():
            if side.trained and side.state is None:  # the game ended before its first turn
                side.state = await _first_state(match, side)
    except BaseException as failure:  # the first error is the one raised; a failing close notes
        with anyio.CancelScope(shield=True):
            close = functools.partial(close_after_failure, env, failure)
            await run_environment_code(close, f"{type(env).__qualname__}.close()", timeout_s)
        raise
    await match.env_code(functools.partial(close_environment, env), "close()")
    return {
        seat: _episode(match, side, side.finish or finish, rewards[seat], place(seat))
        for seat, side in sides.items()
        if side.trained
    }


def _drawn(
    snapshots: Mapping[str, Sequence[GenerationBackend]],
    seat: str,
    sample_seed: int,
    players: Mapping[str, SeatPlayer],
) -> GenerationBackend:
    """The snapshot that plays `seat` in this match: drawn from its pool by the match's seed.

    Raises:
        ValueError: The pool is empty (no snapshot taken yet).
    """
    pool = snapshots[seat]
    if not pool:
        raise ValueError(
            f"seat {seat!r} is a snapshot's, but no snapshot of the policy has been taken yet; "
            "take one before the round (GRPOTrainer does at each round's start)"
        )
    seat_index = list(players).index(seat)
    return pool[random.Random(hash((sample_seed, seat_index))).randrange(len(pool))]


async def _play(match: _Match) -> Finish:
    """The match's turns until the game is over or cut off; returns how it ended."""
    rng = random.Random(match.sample_seed)
    while True:
        seat = await match.env_code(functools.partial(seat_to_move, match.env), "to_move()")
        if seat is None:
            return Finish.ENV_DONE
        player = match.players[seat]
        if player is not None and not isinstance(player, Snapshot):
            move = functools.partial(player, match.env, seat, rng)
            await match.env_code(move, f"move of the scripted player of {seat!r}")
            continue
        side = match.sides[seat]
        if side.state is not None and side.state.turns >= match.ctx.config.max_turns:
            return _cut_off(match, side, Finish.MAX_TURNS)
        finish = await _model_turn(match, side)
        if finish is not None:
            return _cut_off(match, side, finish)


def _cut_off(match: _Match, side: _Seat, finish: Finish) -> Finish:
    """`finish`; a seat cut off (LENGTH, MAX_TURNS) after wasting a turn forfeits the game."""
    if finish in (Finish.LENGTH, Finish.MAX_TURNS) and side.wasted_turns:
        match.forfeit = side.name
    return finish


async def _model_turn(match: _Match, side: _Seat) -> Finish | None:
    """One turn of a model seat; returns a Finish when the game ends (or is cut off) here."""
    ctx = match.ctx
    if side.state is None:
        side.state = await _first_state(match, side)
    elif (finish := await _follow_up(match, side)) is not None:
        return finish
    state = side.state
    window = ctx.window(state.first_prompt_length)
    budget = window - len(state.tokens.context_ids)
    if budget < 1:
        return Finish.LENGTH
    params = ctx.config.sampling(budget, hash((state.sample_seed, state.turns)) % 2**62)
    if side.temperature is not None:
        params = dataclasses.replace(params, temperature=side.temperature)
    completion = await side.backend.generate(state.tokens.context_ids, params)
    state.add_sampled(completion)
    state.turns += 1
    if not completion.stopped:
        state.messages.append({"role": "assistant", "content": ctx.decode(completion.token_ids)})
        side.wasted_turns += 1
        return Finish.LENGTH
    text = ctx.decode(completion.token_ids[:-1])
    side.stop_text = ctx.decode(completion.token_ids[-1:])
    parsed = ctx.parser(text)
    state.messages.append(assistant_message(text, parsed))
    if not parsed.tool_calls and not parsed.errors:
        match.forfeit, side.finish = side.name, Finish.STOP  # no move: the seat forfeits
        return Finish.ENV_DONE
    timeout_s = ctx.config.tool_timeout_s
    results = await run_calls(parsed.tool_calls, _tools(match), ctx.tools.keys(), timeout_s)
    side.pending = [tool_message(r.name, r.content, r.images) for r in results]
    side.pending += [tool_message("error", e) for e in parsed.errors]
    state.tool_calls += len(parsed.tool_calls) + len(parsed.errors)
    state.tool_errors.update(str(r.error) for r in results if r.error is not None)
    state.tool_errors["parse"] += len(parsed.errors)
    state.calls.extend(call_records(parsed, results, side.pending))
    side.wasted_turns += not any(r.error is None for r in results)
    return None


def _tools(match: _Match) -> dict[str, Tool]:
    """The plain tools and the game's, bound to this match's instance."""
    ctx, env = match.ctx, match.env
    bound = {
        n: dataclasses.replace(t, fn=tool_method(env, n)) for n, t in ctx.environment_tools.items()
    }
    return {**ctx.tools, **bound}


async def _first_state(match: _Match, side: _Seat) -> EpisodeState:
    """A seat's conversation at its first turn: the prompt and what the game tells it.

    Raises:
        PromptTooLongError: The prompt leaves no room to generate.
    """
    ctx = match.ctx
    told = await _observe(match, side.name)
    messages = with_observation(match.prompt, told)
    fresh = ctx.renderer.fresh(messages)
    limit, context = ctx.config.max_prompt_length, ctx.backend.context_limit
    if (limit and len(fresh.ids) > limit) or (context and len(fresh.ids) >= context):
        raise PromptTooLongError(
            f"seat {side.name!r}'s first prompt is {len(fresh.ids)} tokens, over the limit "
            f"(max_prompt_length={limit}, model context={context}). Row: {show_row(match.row)}"
        )
    seat_index = list(match.players).index(side.name)
    seed = hash((match.sample_seed, seat_index))
    return EpisodeState(messages, TokenRow(fresh.ids), fresh.prompt_text, seed)


async def _observe(match: _Match, seat: str) -> str | None:
    observe = functools.partial(seat_observation, match.env, seat)
    return await match.env_code(observe, f"observe({seat!r})")


async def _follow_up(match: _Match, side: _Seat) -> Finish | None:
    """Append the seat's last results and what the game tells it now, as one mask-0 delta."""
    ctx, state = match.ctx, side.state
    assert state is not None
    told = await _observe(match, side.name)
    new = [*side.pending, *([{"role": "user", "content": told}] if told else [])]
    side.pending = []
    left = ctx.config.max_completion_length - state.spent
    shown, turn = ctx.renderer.fitted_tool_turn(
        state.prompt_text,
        state.context_messages,
        new,
        side.stop_text,
        (left, ctx.config.max_completion_length),
    )
    state.messages.extend(shown)
    context = len(turn.ids) if turn.fork else len(state.tokens.context_ids) + len(turn.ids)
    if context >= ctx.window(state.first_prompt_length):
        return Finish.LENGTH
    state.add_tool_turn(turn)
    return None


async def _rewards(match: _Match) -> dict[str, float]:
    """Every seat's reward: the game's, or the forfeit rule (the mover loses, others 0.0)."""
    if match.forfeit is not None:
        return {
            seat: ILLEGAL_MOVE_REWARD if seat == match.forfeit else 0.0 for seat in match.players
        }
    rewards = {}
    for seat in match.players:
        score = functools.partial(seat_reward, match.env, seat)
        rewards[seat] = await match.env_code(score, f"reward({seat!r})")
    return rewards


def _episode(
    match: _Match, side: _Seat, finish: Finish, reward: float, place: tuple[int, int]
) -> Episode:
    """The episode of a policy seat: its rows and messages, the seat's reward."""
    state = side.state
    assert state is not None
    state.messages.extend(side.pending)  # the last results, shown as the game ended
    stats = EpisodeStats(state.turns, state.tool_calls, dict(state.tool_errors))
    return Episode(
        rows=state.rows(),
        messages=state.messages,
        finish=finish,
        stats=stats,
        row={**match.row, SEAT_COLUMN: side.name},
        group=place[0],
        index=place[1],
        env_reward=reward,
        environment=match.env,
        tool_calls=tuple(state.calls),
        turns=tuple(state.turn_log),
    )


class MatchEngine(RolloutEngine):
    """A `RolloutEngine` whose environment has seats: each row's episodes are matches.

    `run` plays `num_generations` matches of each row. A match gives one episode per policy
    seat, so a round of R rows gives R x S groups of `num_generations` episodes (S policy
    seats): group ``r * S + j`` holds seat j's side of row r's matches, and its members share
    the row, the seed and the seat. Several environments, agents and ``tools`` columns are
    not supported with seats.

    Args:
        backend, tokenizer: As for `RolloutEngine`.
        environment_factory: The seated environment class.
        players: Seat to player (`environments.seats.seat_players`); None: self-play.
        seat_backends: What samples each `Snapshot` seat's turns: a backend, or a pool of them
            (a league's; a list that its holder may grow between rounds) from which each match
            draws one. One entry per such seat; a policy seat may have one too (its turns,
            still trained, sample from it: a LoRA adapter of its own). Whoever holds a
            snapshot's keeps its weights frozen.
        seat_temperatures: The sampling temperature of `Snapshot` seats that sample at their
            own (0: greedy), e.g. an opponent that always plays its likeliest move; the
            others sample at the config's.
        **options: `RolloutEngine`'s other keyword arguments.

    Raises:
        ValueError: As `seat_players`, the class has no seats, `seat_backends` does not
            match the `Snapshot` seats, or `seat_temperatures` names another seat.
    """

    plays_seats = True

    def __init__(
        self,
        backend: Any,
        tokenizer: Any,
        *,
        environment_factory: type,
        players: Mapping[str, Any] | None = None,
        seat_backends: Mapping[str, GenerationBackend | Sequence[GenerationBackend]] | None = None,
        seat_temperatures: Mapping[str, float] | None = None,
        **options: Any,
    ):
        if not seats_of(environment_factory):
            raise ValueError(f"{environment_factory.__qualname__} declares no seats")
        self.players = seat_players(environment_factory, players)
        self.trained_seats = [seat for seat, p in self.players.items() if p is None]
        self.seat_backends = {  # a pool stays the caller's list: it may grow between rounds
            seat: pool if isinstance(pool, Sequence) else [pool]
            for seat, pool in (seat_backends or {}).items()
        }
        snapshots = sorted(s for s, p in self.players.items() if isinstance(p, Snapshot))
        if not set(snapshots) <= set(self.seat_backends) <= {*snapshots, *self.trained_seats}:
            raise ValueError(
                f"seat_backends has backends for seats {sorted(self.seat_backends)}, but the "
                f"seats a snapshot plays are {snapshots}: give one backend per snapshot seat, "
                "and optionally one per policy seat that samples from its own "
                "(`agentgrpo run` and GRPOTrainer build them; see docs/several-players.md)"
            )
        self.seat_temperatures = dict(seat_temperatures or {})
        if not set(self.seat_temperatures) <= set(snapshots):
            raise ValueError(
                f"seat_temperatures names seats {sorted(self.seat_temperatures)}, but only the "
                f"seats a snapshot or another model plays ({snapshots}) sample at their own "
                "temperature: a policy seat's turns are trained at the run's"
            )
        super().__init__(backend, tokenizer, environment_factory=environment_factory, **options)

    async def run(
        self,
        rows: Sequence[Mapping[str, Any]],
        num_generations: int = 1,
        seed: int = 0,
        on_group: Callable[[list[Episode]], Awaitable[None]] | None = None,
    ) -> list[Episode]:
        """Play `num_generations` matches of each row, all concurrently (see the class).

        Returns:
            Episodes by group: episode ``g * num_generations + k`` is match k's side of seat
            ``g % S`` of row ``g // S``; `on_group` is awaited with each group once its row's
            matches have all ended.
        """
        seats, size = self.trained_seats, num_generations
        played: dict[int, Episode] = {}
        limiter = anyio.CapacityLimiter(self.max_concurrent_episodes)
        unfinished = [size] * len(rows)

        def place(r: int, k: int, seat: str) -> tuple[int, int]:
            group = r * len(seats) + seats.index(seat)
            return group, group * size + k

        async def play(r: int, k: int) -> None:
            async with limiter:
                where = functools.partial(place, r, k)
                sides = await play_match(
                    self.context,
                    rows[r],
                    seed + r,
                    self.players,
                    where,
                    self.seat_backends,
                    self.seat_temperatures,
                )
            played.update({episode.index: episode for episode in sides.values()})
            unfinished[r] -= 1
            if unfinished[r] == 0 and on_group is not None:
                for seat in seats:
                    group = place(r, 0, seat)[0]
                    await on_group([played[group * size + m] for m in range(size)])

        try:
            async with anyio.create_task_group() as tasks:
                for r in range(len(rows)):
                    for k in range(size):
                        tasks.start_soon(play, r, k)
        except BaseExceptionGroup as failures:
            first: BaseException = failures  # one match's error, not the group, is the user's
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
        else:
            return [played[i] for i in range(len(rows) * len(seats) * size)]
        raise first  # outside the handler: its own __cause__ stays intact
