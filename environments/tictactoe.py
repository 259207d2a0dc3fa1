"""TicTacToe: a two-seat game (``x`` and ``o``), the built-in example of an environment with seats.

Each seat marks a cell with the ``mark`` tool on its turn; the seat contract is described in
`environments.seats`. A row may start from an opening (cells already played, in order), so
groups of games start from different positions and either seat may move first.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, ClassVar

from environments.messages import tool_turn
from environments.seats import ILLEGAL_MOVE_REWARD

if TYPE_CHECKING:
    import datasets

_LINES = (
    (0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6),
)  # fmt: skip
_ROWS = {"train": 256, "eval": 64}
RULES = (
    "We are playing tic-tac-toe on a 3x3 board whose cells are numbered 1 to 9, row by row. "
    "On your turn, call the mark tool with the number of an empty cell. Three of your marks in "
    "a row, column or diagonal win; marking a taken cell or not marking loses the game."
)


class TicTacToe:
    """Tic-tac-toe for two seats, ``x`` and ``o``; ``x`` moves first from an empty board.

    Rewards: 1.0 to the winner and -1.0 to the loser, 0.0 each for a draw. A seat that marks
    a taken cell or a cell off the board loses at once: it gets `ILLEGAL_MOVE_REWARD` (-1.0)
    and the other seat 0.0, not a win.

    Examples:
        >>> game = TicTacToe()
        >>> game.reset(opening=[5])
        >>> game.to_move(), game.observe("o").splitlines()[0]
        ('o', 'You play o. x marked 5.')
        >>> game.mark(5)
        'Cell 5 is taken: an illegal move, you lose.'
        >>> game.to_move(), game.reward("o"), game.reward("x")
        (None, -1.0, 0.0)

    """

    seats = ("x", "o")
    # x moves at most 5 times; a sixth turn leaves room for one failed call (`rollout.match`)
    episode_limits: ClassVar[dict[str, int]] = {"max_completion_length": 512, "max_turns": 6}
    run_defaults: ClassVar[dict[str, float]] = {"warm_start_steps": 32, "max_steps": 8}

    def reset(self, opening: list[int] | None = None) -> None:
        """Start from an empty board, then play the `opening` cells (1 to 9) in turn."""
        self.board = [""] * 9
        self.moves: list[tuple[str, int]] = []
        self.seen = {seat: 0 for seat in self.seats}  # moves each seat has been told of
        self.illegal: str | None = None
        for cell in opening or []:
            self._place(cell)

    def to_move(self) -> str | None:
        """The seat whose turn it is; None once the game is over (won, full, or illegal)."""
        if self.illegal is not None or self._winner() is not None or all(self.board):
            return None
        return self.seats[len(self.moves) % 2]

    def observe(self, seat: str) -> str | None:
        """What `seat` is told before its turn: its side, the others' moves, the board."""
        new = self.moves[self.seen[seat] :]
        first = self.seen[seat] == 0
        self.seen[seat] = len(self.moves)
        told = [f"{mover} marked {cell}." for mover, cell in new if mover != seat]
        if first:
            told.insert(0, f"You play {seat}.")
        lines = [" ".join(told)] if told else []
        return "\n".join([*lines, self._picture()])

    def mark(self, cell: int) -> str:
        """Mark an empty cell for the player whose turn it is.

        Args:
            cell: The cell to mark, 1 to 9 (row by row from the top left).

        """
        seat = self.to_move()
        if seat is None:
            return "The game is over."
        if not isinstance(cell, int) or not 1 <= cell <= 9 or self.board[cell - 1]:
            self.illegal = seat
            where = "taken" if isinstance(cell, int) and 1 <= cell <= 9 else "not on the board"
            return f"Cell {cell} is {where}: an illegal move, you lose."
        self._place(cell)
        winner = self._winner()
        if winner is not None:
            return f"You marked {cell} and won."
        return f"You marked {cell}." + (" The board is full: a draw." if all(self.board) else "")

    def legal_moves(self) -> list[dict[str, Any]]:
        """Every empty cell, as a call of ``mark``."""
        return [
            {"name": "mark", "arguments": {"cell": c + 1}} for c in range(9) if not self.board[c]
        ]

    def reward(self, seat: str) -> float:
        """1.0 for a win, -1.0 for a loss or an illegal move, 0.0 otherwise.

        0.0 is a draw, the other seat's illegal move, or a game not finished.
        """
        if self.illegal is not None:
            return ILLEGAL_MOVE_REWARD if seat == self.illegal else 0.0
        winner = self._winner()
        if winner is None:
            return 0.0
        return 1.0 if winner == seat else -1.0

    def _picture(self) -> str:
        """The board, one line per row, ``.`` for an empty cell."""
        cells = [mark or "." for mark in self.board]
        return "\n".join(" ".join(cells[r : r + 3]) for r in (0, 3, 6))

    def _place(self, cell: int) -> None:
        seat = self.seats[len(self.moves) % 2]
        self.board[cell - 1] = seat
        self.moves.append((seat, cell))

    def _winner(self) -> str | None:
        for a, b, c in _LINES:
            if self.board[a] and self.board[a] == self.board[b] == self.board[c]:
                return self.board[a]
        return None

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Rows: ``prompt`` (the rules) and ``opening`` (0 to 2 cells already played).

        train has 256 rows, eval 64, drawn apart.
        """
        if split not in _ROWS:
            raise ValueError(f"TicTacToe has splits {sorted(_ROWS)}, not {split!r}")
        import datasets

        rng = random.Random(f"tictactoe-{split}")
        openings = [rng.sample(range(1, 10), rng.randint(0, 2)) for _ in range(_ROWS[split])]
        prompts = [[{"role": "user", "content": RULES}] for _ in openings]
        return datasets.Dataset.from_dict({"prompt": prompts, "opening": openings})

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """Whole games from one seat's side, played with `good_move` against random moves.

        The seat is ``x`` and ``o`` in turn.
        """
        rng = random.Random(f"tictactoe-demonstrations-{seed}")
        return [_demonstration(cls.seats[i % 2], rng) for i in range(n)]


def _demonstration(seat: str, rng: random.Random) -> list[dict[str, Any]]:
    """One game as `seat` sees it: the prompt, then its moves, their results and the replies."""
    game = TicTacToe()
    game.reset()
    messages: list[dict[str, Any]] = [{"role": "user", "content": RULES}]
    while (mover := game.to_move()) is not None:
        if mover != seat:
            game.mark(rng.choice(game.legal_moves())["arguments"]["cell"])
            continue
        told = game.observe(seat)
        if len(messages) == 1:
            messages[0] = {"role": "user", "content": f"{RULES}\n{told}"}
        else:
            messages.append({"role": "user", "content": told})
        cell = good_move(game.board, seat, rng)
        messages += tool_turn("mark", {"cell": cell}, game.mark(cell))
    return messages


def good_move(board: list[str], seat: str, rng: random.Random) -> int:
    """A cell (1 to 9): one that wins now, else blocks, else the centre, else a random one."""
    empty = [c for c in range(9) if not board[c]]
    for who in (seat, "o" if seat == "x" else "x"):
        for cell in empty:
            if _completes(board, cell, who):
                return cell + 1
    return 5 if 4 in empty else rng.choice(empty) + 1


def _completes(board: list[str], cell: int, who: str) -> bool:
    """Whether marking `cell` for `who` makes a line."""
    return any(cell in line and all(board[c] == who or c == cell for c in line) for line in _LINES)


def good_player(env: TicTacToe, seat: str, rng: random.Random) -> None:
    """A scripted player that plays `good_move`.

    Name it as ``seat_players={"o": "environments.tictactoe:good_player"}``.
    """
    env.mark(good_move(env.board, seat, rng))
