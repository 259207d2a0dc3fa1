r"""TextArena's games by id: ``ta:GuessTheNumber-v0``, ``ta:TicTacToe-v0,opponent=random``, ...

`textarena_environment(spec)` turns the text after ``ta:`` into an environment class. TextArena
(the ``textarena`` package, 0.7.4) keeps a registry of text games (``textarena.make(ID)``) with
its own loop (``reset(num_players, seed)``, ``step(action)``, ``get_observation()``); a
`TextArenaGame` makes one game a gymnasium env with `~gymnasium.spaces.Text` spaces, and
`gym_environment` does the rest:

- single-player games are played as they are. A game of two or more players without
  ``opponent`` is a game with seats, ``player_0``, ``player_1``, ..., each played by any seat
  player (`environments.textarena_seats`); it is played by the fewest players it starts with,
  or by ``players=N``. With ``opponent`` (two-player games only), the model is player 0 and
  the option plays player 1 inside the tool: ``random`` (a random move among those the game
  shows in brackets, ``[4]``), ``first`` (the first such move, newest text first) or
  ``module:function`` / ``path/to/file.py:function``, a function from the opponent's new text
  to its move;
- the move is one tool, ``move(action: str)``, rather than the model's reply: a tool call is
  parsed by the engine already, and its text is exactly the move. TextArena's games read the
  move inside ``[...]``, so an action without ``[`` is bracketed for the model (as TextArena's
  ``ActionFormattingWrapper`` does): ``move("4")`` plays ``[4]``;
- each turn the model reads only what is new since its last move: the game is played without
  TextArena's observation wrappers (the default one repeats the whole history every turn), its
  own echoed move is left out, and of the boards drawn since then only the last is kept;
- an illegal move by the model is reported to it as such (``Illegal move.``, then TextArena's
  reason) and scored as TextArena scores it: a retry while its ``error_allowance`` lasts, then
  the game lost;
- an illegal move by the opponent never becomes the model's win: each opponent move is tried
  on a copy of the game first, and one the game refuses is replaced by the next candidate
  (the moves shown in brackets). When no candidate is legal, the game stops, truncated, and
  scores 0.5, as a draw: neither a win nor a loss of the model's;
- the reward is player 0's final TextArena reward mapped to [0, 1]: a two-player game's
  win 1, draw 0, loss -1 become 1, 0.5 and 0; a single-player game's score (already from 0 to
  1, -1 for a game lost by illegal moves) is clipped to [0, 1]. Steps before the end score 0;
- rows are one prompt per seed (``"train"`` from 0, ``"eval"`` from 1,000,000); the first
  observation is TextArena's prompt for player 0 and the first board.

TextArena seeds Python's global generator in ``reset``, so resets and steps of all TextArena
games in the process run one at a time under one lock; the random opponent draws from a
generator of its own, seeded by the episode's seed, so an episode replays exactly.

Keyword arguments for ``textarena.make`` follow the id as for ``gym:``:
``ta:GuessTheNumber-v0,max_turns=5``.
"""

from __future__ import annotations

import copy
import difflib
import random
import re
import string
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gymnasium
from gymnasium.spaces import Text

from environments.errors import EnvironmentSpecError
from environments.gym_adapter import GymEnvironment, gym_environment, step_limits
from environments.gym_ids import MAX_TURNS, parse_spec
from environments.loading import load_attribute
from tools.threads import describe_error

if TYPE_CHECKING:
    from environments.textarena_seats import TextArenaSeats

TA_PREFIX = "ta:"
INSTALL = "pip install 'agentgrpo[textarena]'"
OPPONENTS = ("random", "first", "module:function")
_TOOL = "move"
_ACTION_MAX = 1000
_TEXT_MAX = 100_000
_OPPONENT_TRIES = 200  # opponent moves in a row before the game is stopped (a game that loops)
GLOBAL_RANDOM = threading.Lock()  # TextArena seeds the global generator in reset
BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")
_MODEL = 0
MAX_PLAYERS = 8  # the most players a ``ta:`` game is tried with when ``players=`` is not given
_CLASSES: dict[tuple[str, tuple[tuple[str, Any], ...]], type[GymEnvironment | TextArenaSeats]] = {}

Opponent = Callable[[str, list[str], random.Random], list[str]]
"""Proposes the opponent's moves in the order to try: (new text, candidates, rng) -> moves."""


class TextArenaGame(gymnasium.Env):
    """A TextArena game as a gymnasium env: the model's moves in, its new text out.

    Attributes:
        illegal_moves: The model's moves the game refused in this episode.
        opponent_replaced: The opponent's moves the game refused and that were replaced.

    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's attribute)

    def __init__(
        self, game_id: str, kwargs: dict[str, Any], players: int, opponent: Opponent | None
    ) -> None:
        self.game = make_textarena(game_id, kwargs)
        self.players = players
        self.opponent = opponent
        self.action_space = Text(min_length=1, max_length=_ACTION_MAX, charset=string.printable)
        self.observation_space = Text(max_length=_TEXT_MAX, charset=string.printable)
        self.illegal_moves = self.opponent_replaced = 0
        self._opponent_seen: list[str] = []
        self._rng = random.Random(0)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A new game for `seed`: TextArena's prompt for player 0 and its first board."""
        super().reset(seed=seed)
        self.illegal_moves = self.opponent_replaced = 0
        self._opponent_seen = []
        self._rng = random.Random(seed)
        with GLOBAL_RANDOM:
            self.game.reset(num_players=self.players, seed=seed)
            text, _ = self._play_opponent()  # player 0 moves first in TextArena's games
            return text, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play the model's move (bracketed when it is not), then the opponent's moves.

        Returns:
            The model's new text, the reward (the mapped final reward once the game ends, else
            0), whether the game ended, whether it was stopped (no legal opponent move), and an
            info dict with ``illegal`` (whether the model's move was refused).

        """
        move = action if "[" in action else f"[{action}]"
        with GLOBAL_RANDOM:
            illegal = not legal_step(self.game, _MODEL, move)
            self.illegal_moves += illegal
            text, stopped = self._play_opponent()
            state = self.game.state
        if illegal:
            ended = " The game is over: illegal moves lose it." if state.done else ""
            text = f"Illegal move.{ended}\n\n{text}"
        if stopped:
            note = "The opponent has no legal move the adapter can find: the game stops, unscored."
            return f"{text}\n\n{note}", 0.5, False, True, {"illegal": illegal}
        if not state.done:
            return text, 0.0, False, False, {"illegal": illegal}
        reward = final_reward(state.rewards, self.players)
        reason = str(state.game_info.get(_MODEL, {}).get("reason", "")).strip()
        over = f"Game over: {reason}" if reason else "Game over."
        return f"{text}\n\n{over} Your score: {reward}.", reward, True, False, {"illegal": illegal}

    def _play_opponent(self) -> tuple[str, bool]:
        """Let the opponent move until it is the model's turn; the model's new text, stopped."""
        state = self.game.state
        for _ in range(_OPPONENT_TRIES):
            if state.done or state.current_player_id == _MODEL or self.opponent is None:
                return new_text(state, _MODEL), False
            if not self._opponent_move():
                return new_text(state, _MODEL), True
            state = self.game.state
        return new_text(state, _MODEL), True

    def _opponent_move(self) -> bool:
        """Play the opponent's first proposed move the game accepts; False when none is."""
        assert self.opponent is not None
        player = self.game.state.current_player_id
        seen = new_text(self.game.state, player)
        self._opponent_seen.append(seen)
        candidates = [
            move
            for text in reversed(self._opponent_seen)
            for move in dict.fromkeys(BRACKETED.findall(text))
        ]
        proposals = self.opponent(seen, list(dict.fromkeys(candidates)), self._rng)
        for index, move in enumerate(proposals):
            if accepts(self.game, player, move):
                self.opponent_replaced += index > 0
                return legal_step(self.game, player, move)
        return False


def textarena_environment(spec: str) -> type[GymEnvironment | TextArenaSeats]:
    """The environment class for a TextArena game id, with optional options.

    Args:
        spec: ``GAME_ID`` or ``GAME_ID,key=value,...`` (the part after ``ta:``), e.g.
            ``TicTacToe-v0,opponent=random``; ``opponent`` picks player 1's moves in a
            two-player game (`OPPONENTS`), ``players`` the number of players (default: the
            fewest the game starts with), the other keys go to ``textarena.make``.

    Returns:
        A `GymEnvironment` subclass with the tool ``move``, ``dataset(split)`` and
        ``episode_limits``; for a game of two or more players without ``opponent``, a
        seated class (`environments.textarena_seats`) with the same tool and rows. The same
        class for the same spec.

    Raises:
        EnvironmentSpecError: textarena is not installed, the id is not in its registry (the
            message lists close matches), a single-player game or one of more than two
            players has an ``opponent``, the opponent is none of `OPPONENTS`, ``players`` is
            not a number the game starts with, or the game fails to start.

    """
    game_id, kwargs = parse_spec(spec, TA_PREFIX, "TicTacToe-v0,opponent=random")
    key = (game_id, tuple(sorted((name, repr(value)) for name, value in kwargs.items())))
    if key not in _CLASSES:
        _CLASSES[key] = _build(game_id, kwargs)
    return _CLASSES[key]


def _build(game_id: str, kwargs: dict[str, Any]) -> type[GymEnvironment | TextArenaSeats]:
    label = f"{TA_PREFIX}{game_id}"
    opponent_name = kwargs.pop("opponent", None)
    players = _players(game_id, kwargs, kwargs.pop("players", None))
    if players >= 2 and opponent_name is None:
        # imported here: textarena_seats builds on this module's helpers
        from environments.textarena_seats import seated_textarena

        return seated_textarena(game_id, kwargs, players)
    if players == 1 and opponent_name is not None:
        raise EnvironmentSpecError(
            f"{label} is a single-player game: it takes no opponent; drop opponent="
        )
    if players > 2:
        raise EnvironmentSpecError(
            f"{label} is played by {players} players; opponent= plays player 1 of a two-player "
            "game only: drop opponent= to play it with seats (player_0 ... "
            f"player_{players - 1}) and choose who plays each with --seat-players"
        )
    opponent = None if opponent_name is None else opponent_from_option(opponent_name, label)
    probe = TextArenaGame(game_id, kwargs, players, opponent)
    instructions, _ = probe.reset(seed=0)
    versus = "" if players == 1 else f" against a {opponent_name} opponent"
    cls = gym_environment(
        lambda: TextArenaGame(game_id, kwargs, players, opponent),
        name="TextArena" + re.sub(r"\W", "_", game_id),
        action_tool=_TOOL,
        action_doc=f"Make one move in the TextArena game {game_id}; returns what happens next.",
        argument_doc="Your move, as the instructions ask for it, e.g. [4]; the brackets may be "
        "left out.",
        prompt=f"Play the TextArena game {game_id}{versus} with the {_TOOL} tool: each call "
        "makes one move and returns what happened since. The instructions follow.",
        description=f"The TextArena game {game_id}{versus}, played with {_TOOL}; reward: the "
        "final result, from 0 (lost) to 1 (won).",
    )
    cls.episode_limits = step_limits(MAX_TURNS, instructions)  # type: ignore[attr-defined]
    return cls


def make_textarena(game_id: str, kwargs: dict[str, Any]) -> Any:
    """``textarena.make(game_id, **kwargs)`` without TextArena's wrappers (the bare game).

    Raises:
        EnvironmentSpecError: As `textarena_environment` says.

    """
    label = f"{TA_PREFIX}{game_id}"
    textarena = _import_textarena(label)
    registry = textarena.envs.registration.ENV_REGISTRY
    if game_id not in registry:
        close = difflib.get_close_matches(game_id, list(registry), n=5, cutoff=0.6)
        hint = f" (close matches: {', '.join(close)})" if close else ""
        raise EnvironmentSpecError(
            f'{label}: TextArena has no game {game_id!r}{hint}; `python -c "import textarena; '
            'textarena.pprint_registry_detailed()"` lists its games'
        )
    try:
        game = textarena.make(game_id, **kwargs)
    except Exception as error:
        raise EnvironmentSpecError(
            f"{label}: textarena.make({game_id!r}, {kwargs}) failed: {describe_error(error)}"
        ) from error
    while isinstance(game, textarena.Wrapper):
        game = game.env
    return game


def opponent_from_option(name: object, label: str = TA_PREFIX) -> Opponent:
    """The opponent the ``opponent`` option names: ``random``, ``first`` or a function.

    A function (``module:function`` or ``path/to/file.py:function``) takes the opponent's new
    text and returns its move; when the game refuses that move, the moves shown in brackets are
    tried in order after it.

    Raises:
        EnvironmentSpecError: The option is none of `OPPONENTS`, or its function is missing.

    """
    if name == "random":
        return _random_moves
    if name == "first":
        return _first_moves
    if not isinstance(name, str) or ":" not in name:
        raise EnvironmentSpecError(
            f"{label}: opponent={name!r} is not an opponent; use one of: {', '.join(OPPONENTS)}"
        )

    function = load_attribute(name)
    if not callable(function):
        raise EnvironmentSpecError(f"{label}: opponent={name!r} names a non-callable object")

    def moves(seen: str, candidates: list[str], rng: random.Random) -> list[str]:
        return [str(function(seen)), *candidates]

    return moves


def final_reward(rewards: dict[int, float] | None, players: int) -> float:
    """Player 0's TextArena reward mapped to [0, 1] (the module docstring says how).

    Examples:
        >>> final_reward({0: 1, 1: -1}, 2), final_reward({0: 0, 1: 0}, 2)
        (1.0, 0.5)
        >>> final_reward({0: 0.4}, 1), final_reward({0: -1}, 1), final_reward(None, 1)
        (0.4, 0.0, 0.0)

    """
    value = float((rewards or {}).get(_MODEL, 0.0 if players == 1 else -1.0))
    mapped = (value + 1) / 2 if players == 2 else value
    return min(1.0, max(0.0, mapped))


def new_text(state: Any, player: int) -> str:
    """What `player` has been shown since it last read, taken from its queue (`shown_text`)."""
    messages = list(state.observations[player])
    state.observations[player] = []
    return shown_text(messages, player)


def shown_text(messages: list[Any], player: int) -> str:
    """TextArena's `messages` for `player` as one text, as the model reads them.

    Its own echoed moves are left out, and of the boards only the last one is kept.
    """
    from textarena import GAME_ID, ObservationType

    boards = [i for i, (_, _, kind) in enumerate(messages) if kind is ObservationType.GAME_BOARD]
    parts = []
    for index, (sender, text, kind) in enumerate(messages):
        if kind is ObservationType.PLAYER_ACTION and sender == player:
            continue
        if kind is ObservationType.GAME_BOARD and index != boards[-1]:
            continue
        parts.append(text if sender == GAME_ID else f"[Player {sender}] {text}")
    return "\n\n".join(part.strip() for part in parts)


def _random_moves(seen: str, candidates: list[str], rng: random.Random) -> list[str]:
    return rng.sample(candidates, len(candidates))


def _first_moves(seen: str, candidates: list[str], rng: random.Random) -> list[str]:
    return candidates


def legal_step(game: Any, player: int, move: str) -> bool:
    """Step `game` with `player`'s `move`; False when the game refused it as illegal.

    TextArena counts a turn only for a legal move, and marks a move that loses the game for
    being illegal in ``game_info[player]["invalid_move"]``.
    """
    state = game.state
    turn = state.turn
    game.step(action=move)
    state = game.state
    refused_again = not state.done and state.turn == turn and state.current_player_id == player
    return not (refused_again or state.game_info[player]["invalid_move"])


def accepts(game: Any, player: int, move: str) -> bool:
    """Whether `game` takes `move` from `player`, tried on a copy (global generator kept)."""
    generator = random.getstate()
    try:
        return legal_step(copy.deepcopy(game), player, move)
    finally:
        random.setstate(generator)


def _players(game_id: str, kwargs: dict[str, Any], asked: Any = None) -> int:
    """How many players play the game: `asked` (``players=``), else the fewest it starts with.

    Without `asked`, the counts from 1 to `MAX_PLAYERS` are tried in turn.

    Raises:
        EnvironmentSpecError: `asked` is not a whole number of at least 1, or the game does
            not start with it (or, when not asked, with any count up to `MAX_PLAYERS`).
    """
    label = f"{TA_PREFIX}{game_id}"
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise EnvironmentSpecError(
            f"{label},players={asked!r}: players= must be a whole number >= 1"
        )
    game = make_textarena(game_id, kwargs)
    failures = []
    for players in range(1, MAX_PLAYERS + 1) if asked is None else (asked,):
        try:
            with GLOBAL_RANDOM:
                game.reset(num_players=players, seed=0)
            return players
        except Exception as error:
            failures.append(f"{players}: {describe_error(error)}")
    if asked is not None:
        raise EnvironmentSpecError(
            f"{label} does not start with players={asked} ({failures[0]}); ask for a number "
            "of players the game takes, or drop players= to play the fewest it takes"
        )
    raise EnvironmentSpecError(
        f"{label} starts with no number of players from 1 to {MAX_PLAYERS} ({'; '.join(failures)})"
    )


def _import_textarena(label: str) -> Any:
    """``import textarena``; a missing package says how to install it."""
    try:
        import textarena
    except ImportError as error:
        raise EnvironmentSpecError(
            f"{label} needs TextArena (textarena), which does not import here "
            f"({describe_error(error)}); install it: {INSTALL}"
        ) from error
    return textarena
