r"""TextArena's games of two or more players, with seats: ``ta:TicTacToe-v0`` (no ``opponent=``).

`seated_textarena(game_id, kwargs)` builds an environment class that meets the seat contract
(`environments.seats`), so any seat player plays either side: the policy (self-play),
``"random"``, a snapshot, another model, a scripted function or a trained adapter.

- ``seats`` is ``("player_0", "player_1", ...)``: TextArena's player 0, player 1, ..., as many
  as the game is reset with (`seated_textarena`'s `players`);
- ``to_move()`` is TextArena's current player as a seat, None once the game is done;
- ``observe(seat)`` is what TextArena has shown that player since it last read (its prompt and
  the first board at its first turn), as the ``ta:`` adapter shows it: the player's own echoed
  move left out, of the boards only the last;
- the one tool, ``move(action)``, plays the move of the seat to move (bracketed when it has no
  ``[``, as for ``opponent=`` games) and returns what that seat is shown right after it;
- ``legal_moves()`` lists the moves the seat to move has been shown in brackets (TicTacToe's
  ``Available Moves: '[0]', ...``), newest first, that the game accepts when tried on a copy;
  the ``"random"`` player draws from them. A game that shows no bracketed moves lists none,
  so ``"random"`` stops there with an error: give such a seat another player;
- an illegal move is handled as TextArena handles it: the mover is told (``Illegal move.``,
  then the reason) and moves again while the game's ``error_allowance`` lasts (one retry);
  then the game ends, and instead of TextArena's win for the other players the mover gets
  `ILLEGAL_MOVE_REWARD` and every other seat 0.0;
- ``reward(seat)`` is the player's final TextArena reward (1 won, 0 draw, -1 lost in the
  two-player games; each game's own scale beyond), 0.0 before the end.

Rows are one prompt per seed, as for every ``ta:`` game (`PromptRows`).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from environments.gym_adapter import PromptRows, step_limits
from environments.gym_ids import MAX_TURNS
from environments.seats import ILLEGAL_MOVE_REWARD
from environments.textarena_adapter import (
    BRACKETED,
    GLOBAL_RANDOM,
    accepts,
    legal_step,
    make_textarena,
    shown_text,
)

_TOOL = "move"


class TextArenaSeats(PromptRows):
    """A TextArena game with a seat per player; subclassed per game id and player count.

    Subclasses set ``seats`` (``player_0``, ``player_1``, ...), ``_game_id`` and ``_kwargs``
    (for ``textarena.make``) and ``prompt``.
    """

    seats: ClassVar[tuple[str, ...]]
    _game_id: ClassVar[str]
    _kwargs: ClassVar[dict[str, Any]]

    def reset(self, seed: int | None = None) -> None:
        """A new game for `seed` (the members of a group share one, hence one game)."""
        self._game = make_textarena(self._game_id, self._kwargs)
        self._unread: list[list[Any]] = [[] for _ in self.seats]  # not yet shown, per player
        self._history: list[list[str]] = [[] for _ in self.seats]  # shown, oldest first
        with GLOBAL_RANDOM:
            self._game.reset(num_players=len(self.seats), seed=seed)

    def to_move(self) -> str | None:
        """The seat of TextArena's current player; None once the game is done."""
        state = self._game.state
        return None if state.done else self.seats[state.current_player_id]

    def observe(self, seat: str) -> str | None:
        """What `seat`'s player has been shown since it last read; None when nothing."""
        player = self.seats.index(seat)
        self._collect(player)
        text = shown_text(self._unread[player], player)
        self._unread[player] = []
        return text or None

    def move(self, action: str) -> str:
        """Make one move for the player whose turn it is; returns what that player sees next.

        Args:
            action: The move, as the game's instructions ask for it, e.g. [4]; the brackets
                may be left out.

        """
        state = self._game.state
        if state.done:
            return "The game is over."
        player = state.current_player_id
        played = action if "[" in action else f"[{action}]"
        with GLOBAL_RANDOM:
            legal = legal_step(self._game, player, played)
        self._collect(player)
        text = shown_text(self._unread[player], player)
        self._unread[player] = []
        if not legal:
            ended = " The game is over: illegal moves lose it." if self._game.state.done else ""
            text = f"Illegal move.{ended}\n\n{text}"
        if self._game.state.done:
            reason = str(self._game.state.game_info.get(player, {}).get("reason", "")).strip()
            text += f"\n\nGame over: {reason}" if reason else "\n\nGame over."
        return text.strip()

    def legal_moves(self) -> list[dict[str, Any]]:
        """The bracketed moves the player to move was shown, newest first, that the game takes.

        Each is a call of ``move``; [] once the game is done.
        """
        state = self._game.state
        if state.done:
            return []
        player = state.current_player_id
        self._collect(player)
        candidates = dict.fromkeys(
            move for text in reversed(self._history[player]) for move in BRACKETED.findall(text)
        )
        with GLOBAL_RANDOM:
            legal = [move for move in candidates if accepts(self._game, player, move)]
        return [{"name": _TOOL, "arguments": {"action": move}} for move in legal]

    def reward(self, seat: str) -> float:
        """The player's final TextArena reward; `ILLEGAL_MOVE_REWARD` / 0.0 after an illegal move.

        0.0 while the game goes on.
        """
        state = self._game.state
        if not state.done:
            return 0.0
        player = self.seats.index(seat)
        breaker = [p for p in range(len(self.seats)) if state.game_info[p].get("invalid_move")]
        if breaker:
            return ILLEGAL_MOVE_REWARD if player in breaker else 0.0
        return float((state.rewards or {}).get(player, 0.0))

    def _collect(self, player: int) -> None:
        """Move TextArena's queue of `player` into its unread messages and its history."""
        messages = list(self._game.state.observations[player])
        self._game.state.observations[player] = []
        self._unread[player].extend(messages)
        self._history[player].extend(text for _, text, _ in messages)


def seated_textarena(
    game_id: str, kwargs: dict[str, Any], players: int = 2
) -> type[TextArenaSeats]:
    """The seated class of TextArena's `game_id` (`textarena.make` `kwargs`) for `players` seats.

    Raises:
        EnvironmentSpecError: As `environments.textarena_adapter.make_textarena`.
    """
    seats = tuple(f"player_{p}" for p in range(players))
    cls: type[TextArenaSeats] = type(
        "TextArena" + re.sub(r"\W", "_", game_id),
        (TextArenaSeats,),
        {
            "__doc__": f"The TextArena game {game_id} for {players} seats ({', '.join(seats)}), "
            f"played with {_TOOL}; reward: each player's final result (1 won, 0 draw, -1 lost).",
            "__module__": __name__,
            "seats": seats,
            "_game_id": game_id,
            "_kwargs": dict(kwargs),
            "prompt": f"Play the TextArena game {game_id} with the {_TOOL} tool: each call makes "
            "one move. The instructions and the board follow.",
        },
    )
    probe = cls()
    probe.reset(seed=0)
    first = probe.observe(seats[0]) or ""
    cls.episode_limits = step_limits(MAX_TURNS, first)  # type: ignore[attr-defined]
    return cls
