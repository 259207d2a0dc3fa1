"""Games with seats: the contract of an environment that several players take turns in.

A seated environment is an environment (`environments.contract`) with these members:

- ``seats``: a class attribute, a tuple of two or more distinct seat names (``("x", "o")``).
- ``reset(**row) -> str | None``: starts the game, as for any environment; the text it returns
  is appended to the last user message of every seat's prompt.
- ``to_move(self) -> str | None``: the seat whose turn it is; None once the game is over.
- ``observe(self, seat) -> str | None``: what `seat` is told just before its turn: on its first
  turn this is appended to its prompt (its side, the board), on later turns it follows its own
  last tool results as a user message (the other seats' moves, as the game reports them).
  None: nothing to tell.
- ``reward(self, seat) -> float``: the seat's reward once the game has ended. Zero-sum games
  give opposite rewards; general-sum games any rewards.
- Tools: every other public method, as for any environment. A tool always acts for the seat
  that is to move when it is called.
- ``legal_moves(self) -> list[dict]`` (optional): the moves the seat to move may make, each
  ``{"name": tool, "arguments": {...}}``. The ``"random"`` player draws from them.

Each seat has its own conversation, rendered through the chat template token-exactly, and its
own rows (`rollout.match`). A seat is played by the policy (``"policy"``: its turns are
trained), by another trained policy of the run (``"adapter:NAME"``, a LoRA adapter of the same
base model: `seat_adapters`), by a frozen snapshot of the policy (``"snapshot"``,
``"snapshot:N"``, or one drawn per game from a pool of earlier snapshots, ``"league:N:K"``: a
`Snapshot`, never trained), by another model loaded from a folder (``"model:PATH"``: an
`OtherModel`, never trained), by ``"random"`` (a uniformly random legal move), or by a scripted
function ``(env, seat, rng) -> None`` that makes its move by calling the environment's tools.

Illegal moves are data, with one penalty: the seat that breaks the rules (an illegal move, or
a turn that makes no move at all) gets `ILLEGAL_MOVE_REWARD` and every other seat gets 0.0,
never a win: the other seats did nothing to earn one. The match driver applies this rule to a
turn without a tool call; a game applies it to the illegal moves it detects (ending the game),
as `environments.tictactoe.TicTacToe` does.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.errors import EnvironmentSpecError

ILLEGAL_MOVE_REWARD = -1.0
"""The reward of a seat that breaks the rules; the other seats get 0.0 in that game."""

SEAT_MEMBERS: frozenset[str] = frozenset({"seats", "to_move", "observe", "legal_moves"})
"""Names a seated environment uses for the contract: never tools in such a class."""

POLICY = "policy"
RANDOM = "random"
SNAPSHOT = "snapshot"
LEAGUE = "league"
ADAPTER = "adapter"
MODEL = "model"
MODEL_FILES = ("config.json", "adapter_config.json")
"""What a ``"model:PATH"`` folder holds: a saved model, or a PEFT adapter on a base model."""
POLICY_ADAPTER = "default"
"""The name PEFT gives the run's own adapter (``"policy"``): no ``"adapter:NAME"`` may take it."""

#: A scripted player: makes the move of `seat` on `env` by calling its tools.
ScriptedPlayer = Callable[[Any, str, random.Random], None]


@dataclass(frozen=True)
class Snapshot:
    """A seat played by a frozen copy of the policy's weights: it samples turns, never trains.

    Named ``"snapshot"`` (taken at the first round, never refreshed), ``"snapshot:N"`` (taken
    again every N optimizer steps) or ``"league:N:K"`` (league play: a pool of the K latest
    snapshots, one taken every N steps, each game drawing one of them). Whoever runs the match
    holds the copies and their generation backends (`rollout.match.MatchEngine`'s
    ``seat_backends``): the match plays every `Snapshot` seat, an `OtherModel`'s too, with the
    backends it is handed, and gives it no episode.

    Attributes:
        every: Optimizer steps between two snapshots; None: only the first is ever taken.
        pool: The most snapshots kept; a new one replaces the oldest.
    """

    every: int | None = None
    pool: int = 1


@dataclass(frozen=True)
class OtherModel(Snapshot):
    """A seat played by another model, loaded from a folder: a snapshot that is never refreshed.

    Named ``"model:PATH"``, PATH a folder saved with ``save_pretrained``: a model, or a PEFT
    adapter on a base model (an earlier run's model, a run's warm start). It samples turns with
    the run's tokenizer and chat template, so its vocabulary must be the policy's; whoever runs
    the match loads it once and hands its backend on (``seat_backends``), as for a `Snapshot`.

    Attributes:
        path: The folder, as named (``~`` expanded); it exists and holds `MODEL_FILES`.
    """

    path: str = field(kw_only=True)


#: Who plays a seat: None for the policy (trained), a `Snapshot` (an `OtherModel` among them),
#: or a scripted player.
SeatPlayer = ScriptedPlayer | Snapshot | None


def is_seated(cls: type) -> bool:
    """Whether `cls` declares seats (a ``seats`` class attribute)."""
    return getattr(cls, "seats", None) is not None


def refuse_games(factories: Iterable[Any], engine: str) -> None:
    """Refuse games with seats where `engine` plays one episode at a time, without seats.

    Raises:
        ValueError: A factory is an environment class that declares ``seats``.
    """
    for factory in factories:
        if isinstance(factory, type) and is_seated(factory):
            raise ValueError(
                f"{factory.__qualname__} is a game with seats, which {engine} cannot play (each "
                "seat has its own turns and reward): use rollout.match.MatchEngine, as "
                "`agentgrpo run` and GRPOTrainer do, with that class alone (not in a dict)"
            )


def seats_of(cls: type) -> tuple[str, ...]:
    """The seats `cls` declares, checked; () for an environment without seats.

    Raises:
        EnvironmentSpecError: ``seats`` is not a tuple of two or more distinct, non-empty
            strings.

    Examples:
        >>> class Game:
        ...     seats = ("x", "o")
        >>> seats_of(Game)
        ('x', 'o')
    """
    seats = getattr(cls, "seats", None)
    if seats is None:
        return ()
    valid = isinstance(seats, tuple) and all(isinstance(s, str) and s for s in seats)
    if not valid or len(seats) < 2 or len(set(seats)) != len(seats):
        raise EnvironmentSpecError(
            f"{cls.__qualname__}.seats is {seats!r}; it must be a tuple of two or more distinct "
            "seat names, e.g. seats = ('x', 'o')"
        )
    return seats


def check_seats(cls: type) -> None:
    """Check a seated class's members (`seats`, `to_move`, `observe`, `reward(seat)`).

    Raises:
        EnvironmentSpecError: The first member missing or of the wrong shape, with the fix.
    """
    if not seats_of(cls):
        return
    name = cls.__qualname__
    for member, shape in (
        ("to_move", "def to_move(self) -> str | None"),
        ("observe", "def observe(self, seat: str) -> str | None"),
        ("reward", "def reward(self, seat: str) -> float"),
    ):
        method = inspect.getattr_static(cls, member, None)
        if not inspect.isfunction(method) or inspect.iscoroutinefunction(method):
            raise EnvironmentSpecError(
                f"{name} declares seats, so it needs a plain method `{shape}`"
            )
        wants_seat = member != "to_move"
        if len(inspect.signature(method).parameters) != 1 + wants_seat:
            raise EnvironmentSpecError(f"{name}.{member} must be `{shape}`")
    if hasattr(cls, "legal_moves") and not inspect.isfunction(
        inspect.getattr_static(cls, "legal_moves")
    ):
        raise EnvironmentSpecError(f"{name}.legal_moves must be `def legal_moves(self) -> list`")


def seat_to_move(env: Any) -> str | None:
    """``env.to_move()``, checked to name one of its seats (or None: the game is over).

    Raises:
        EnvironmentSpecError: It named something else.
    """
    seat = env.to_move()
    if seat is not None and seat not in type(env).seats:
        raise EnvironmentSpecError(
            f"{type(env).__qualname__}.to_move() returned {seat!r}; it must return one of its "
            f"seats {list(type(env).seats)} or None when the game is over"
        )
    return seat


def seat_observation(env: Any, seat: str) -> str | None:
    """``env.observe(seat)``, checked to be text or None.

    Raises:
        EnvironmentSpecError: It returned something else.
    """
    text = env.observe(seat)
    if text is not None and not isinstance(text, str):
        raise EnvironmentSpecError(
            f"{type(env).__qualname__}.observe({seat!r}) returned {type(text).__name__}; it "
            "must return text or None"
        )
    return text


def seat_reward(env: Any, seat: str) -> float:
    """``env.reward(seat)`` as a finite float.

    Raises:
        EnvironmentSpecError: It returned something that is not a finite number.
    """
    value = env.reward(seat)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise EnvironmentSpecError(
            f"{type(env).__qualname__}.reward({seat!r}) returned {value!r}; it must return a "
            "finite number"
        )
    if abs(value) == float("inf"):
        raise EnvironmentSpecError(f"{type(env).__qualname__}.reward({seat!r}) is infinite")
    return float(value)


def random_player(env: Any, seat: str, rng: random.Random) -> None:
    """Make a uniformly random legal move (``legal_moves``) for `seat`.

    Raises:
        EnvironmentSpecError: The environment has no ``legal_moves``, or it listed none while
            the game goes on.
    """
    moves = getattr(env, "legal_moves", None)
    if moves is None:
        raise EnvironmentSpecError(
            f"the 'random' player needs {type(env).__qualname__}.legal_moves() -> list of "
            "{'name': tool, 'arguments': {...}}; add it, or give the seat a scripted player"
        )
    legal = list(moves())
    if not legal:
        raise EnvironmentSpecError(
            f"{type(env).__qualname__}.legal_moves() is empty while {seat!r} is to move"
        )
    move = rng.choice(legal)
    getattr(env, move["name"])(**move.get("arguments", {}))


def seat_players(cls: type, players: Mapping[str, Any] | None) -> dict[str, SeatPlayer]:
    """Who plays each seat of `cls`: None for the policy, a `Snapshot`, or a scripted player.

    Args:
        cls: A seated environment class.
        players: Seat to player: ``"policy"``, ``"adapter:NAME"`` (trained: the match plays it
            as the policy's; `seat_adapters`), ``"snapshot"`` or ``"snapshot:N"`` (a frozen
            copy of the policy, refreshed every N optimizer steps), ``"random"``,
            ``"module:function"`` (a scripted player imported by name) or a callable
            ``(env, seat, rng) -> None``. Seats left out are played by the policy; None:
            self-play, every seat the policy's.

    Raises:
        ValueError: A seat the class lacks, a player that is none of these, no seat left to
            the policy (nothing to train), or players given for an environment without seats.
    """
    seats = seats_of(cls)
    players = dict(players or {})
    if players and not seats:
        raise ValueError(
            f"seat_players is set but {cls.__qualname__} declares no seats (a `seats` class "
            "attribute); leave seat_players unset, or use a game with seats (env:TicTacToe)"
        )
    if unknown := sorted(set(players) - set(seats)):
        raise ValueError(f"seat_players names {unknown}; {cls.__qualname__}'s seats are {seats}")
    chosen = {seat: _player(seat, players.get(seat, POLICY)) for seat in seats}
    if seats and all(player is not None for player in chosen.values()):
        raise ValueError(
            f"seat_players gives every seat of {cls.__qualname__} another player than the "
            f"policy, so no seat is trained; let at least one be '{POLICY}'"
        )
    return chosen


def _player(seat: str, player: Any) -> SeatPlayer:
    """One seat's player (see `seat_players`)."""
    if callable(player) or isinstance(player, Snapshot):
        return player
    if player == POLICY:
        return None
    if isinstance(player, str) and player.partition(":")[0] == ADAPTER:
        adapter_name(seat, player)  # a trained seat: the match plays it as the policy's
        return None
    if player == RANDOM:
        return random_player
    if isinstance(player, str) and player.partition(":")[0] in (SNAPSHOT, LEAGUE):
        return _snapshot(seat, player)
    if isinstance(player, str) and player.partition(":")[0] == MODEL:
        return _other_model(seat, player)
    if isinstance(player, str) and ":" in player:
        module, _, name = player.partition(":")
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as error:
            message = f"seat_players[{seat!r}]={player!r} cannot be imported: {error}"
            raise ValueError(message) from error
        if callable(found):
            return found
    raise ValueError(
        f"seat_players[{seat!r}]={player!r} is not a player; use '{POLICY}' (trained), "
        f"'{SNAPSHOT}' or '{SNAPSHOT}:N' (a frozen copy of the policy, refreshed every N steps), "
        f"'{LEAGUE}:N:K' (one of its K latest snapshots, taken every N steps, drawn per game), "
        f"'{ADAPTER}:NAME' (a trained LoRA adapter of its own), '{MODEL}:PATH' (another model, "
        f"saved in the folder PATH, never trained), '{RANDOM}' (a random legal move), "
        "'module:function' or a callable (env, seat, rng)"
    )


def seat_adapters(cls: type, players: Mapping[str, Any] | None) -> dict[str, str]:
    """The trained adapter of each seat `players` gives one: seat to adapter name.

    ``"adapter:NAME"`` makes a seat another trained policy of the run, a LoRA adapter NAME of
    the same base model beside the run's own (``"policy"``, PEFT's ``"default"``). Seats that
    name one adapter share it. Seats not in the result are not played by a named adapter.

    Raises:
        ValueError: As `seat_players`, or a NAME that is not a Python identifier or is
            ``"default"`` or ``"policy"``.

    Examples:
        >>> class Game:
        ...     seats = ("x", "o")
        >>> seat_adapters(Game, {"o": "adapter:solver", "x": "policy"})
        {'o': 'solver'}
    """
    seat_players(cls, players)  # every player checked, and a seat left to train
    return {
        seat: adapter_name(seat, player)
        for seat, player in (players or {}).items()
        if isinstance(player, str) and player.partition(":")[0] == ADAPTER
    }


def adapter_name(seat: str, player: str) -> str:
    """NAME of ``"adapter:NAME"`` (`seat`'s player), checked (see `seat_adapters`)."""
    name = player.partition(":")[2]
    if not name.isidentifier() or name in (POLICY_ADAPTER, POLICY):
        raise ValueError(
            f"seat_players[{seat!r}]={player!r}: name the adapter with a Python identifier "
            f"other than '{POLICY_ADAPTER}' and '{POLICY}' (the run's own adapter, which "
            f"'{POLICY}' plays), e.g. '{ADAPTER}:solver'"
        )
    return name


def _snapshot(seat: str, player: str) -> Snapshot:
    """``"snapshot"``, ``"snapshot:N"`` or ``"league:N:K"`` as a `Snapshot`.

    Raises:
        ValueError: N or K is not a whole number of 1 or more (K: 2 or more), or missing.
    """
    kind, *numbers = player.split(":")
    counts = [int(n) if n.isdigit() else 0 for n in numbers]
    if kind == SNAPSHOT and len(counts) <= 1 and all(n >= 1 for n in counts):
        return Snapshot(counts[0] if counts else None)
    if kind == LEAGUE and len(counts) == 2 and counts[0] >= 1 and counts[1] >= 2:
        return Snapshot(counts[0], counts[1])
    raise ValueError(
        f"seat_players[{seat!r}]={player!r}: use '{SNAPSHOT}' (never refreshed), '{SNAPSHOT}:N' "
        f"(N, the optimizer steps between refreshes, a whole number of 1 or more, e.g. "
        f"'{SNAPSHOT}:10') or '{LEAGUE}:N:K' (K, the snapshots kept, 2 or more, e.g. "
        f"'{LEAGUE}:10:4')"
    )


def _other_model(seat: str, player: str) -> OtherModel:
    """``"model:PATH"`` as an `OtherModel`, its folder checked.

    Raises:
        ValueError: PATH is missing, is not a folder, or holds neither ``config.json`` nor
            ``adapter_config.json``.
    """
    named = player.partition(":")[2]
    path = Path(named).expanduser()
    fix = (
        f"use '{MODEL}:PATH', PATH a folder saved with save_pretrained (a model, or a PEFT "
        f"adapter on one), e.g. '{MODEL}:runs/tictactoe/warm_start'"
    )
    if not named:
        raise ValueError(f"seat_players[{seat!r}]={player!r} names no folder; {fix}")
    if not path.is_dir():
        raise ValueError(
            f"seat_players[{seat!r}]={player!r}: there is no folder {path.resolve()}; {fix}"
        )
    if not any((path / name).is_file() for name in MODEL_FILES):
        raise ValueError(
            f"seat_players[{seat!r}]={player!r}: {path.resolve()} holds neither "
            f"{' nor '.join(MODEL_FILES)}; {fix}"
        )
    return OtherModel(path=str(path))
