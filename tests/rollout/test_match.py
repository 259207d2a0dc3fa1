"""Matches of a game with seats against a scripted backend: rows per seat, masks, rewards."""

from __future__ import annotations

import random
import re

import anyio
import pytest

from environments import EnvironmentSpecError, check_environment, class_tools, tool_names
from environments.seats import ILLEGAL_MOVE_REWARD, seat_players
from environments.tictactoe import TicTacToe, good_move
from rollout import ChatRenderer, EpisodeConfig, Finish, ScriptedBackend, load_template
from rollout.match import MatchEngine
from tests.support.episodes import assert_demonstrations_train_every_call, tool_call

ROW = {"prompt": [{"role": "user", "content": "Play tic-tac-toe."}], "opening": []}


def seat_script(tokenizer, moves: dict[str, list[str]]) -> ScriptedBackend:
    """Seat s's k-th turn says moves[s][k]; the seat is read from its own conversation."""
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        text = tokenizer.decode(context)
        seat = re.search(r"You play (\w)\.", text).group(1)
        turn = text.count("<|im_start|>assistant\n") - 1
        return tokenizer.encode(moves[seat][turn], add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos])


def match_engine(tokenizer, backend, players=None) -> MatchEngine:
    return MatchEngine(
        backend,
        tokenizer,
        environment_factory=TicTacToe,
        players=players,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512, max_turns=5),
    )


def marks(*cells: int) -> list[str]:
    return [tool_call("mark", cell=c) for c in cells]


def play(tokenizer, moves, num_generations=1, players=None, row=ROW):
    engine = match_engine(tokenizer, seat_script(tokenizer, moves), players)
    return anyio.run(engine.run, [row], num_generations)


def test_each_seat_gets_its_own_token_exact_row_with_only_its_turns_trained(tokenizer):
    x, o = play(tokenizer, {"x": marks(1, 2, 3), "o": marks(4, 5)})
    schemas = [tool.schema for tool in class_tools(TicTacToe).values()]
    renderer = ChatRenderer(tokenizer, load_template(tokenizer, "chatml_tools"), schemas)
    for episode, cells in ((x, (1, 2, 3)), (o, (4, 5))):
        [row] = episode.rows
        trained = [t for t, m in zip(row.completion_ids, row.loss_mask, strict=True) if m]
        eos = tokenizer.eos_token
        assert tokenizer.decode(trained) == "".join(m + eos for m in marks(*cells))
        masked = [lp for lp, m in zip(row.sampler_logprobs, row.loss_mask, strict=True) if not m]
        assert set(masked) == {0.0}
        last = max(i for i, m in enumerate(episode.messages) if m["role"] == "assistant")
        played = renderer.render(episode.messages[: last + 1], generation_prompt=False)
        assert played.startswith(tokenizer.decode(row.prompt_ids + row.completion_ids))
        first_prompt = renderer.fresh(episode.messages[:1])
        assert row.prompt_ids == first_prompt.ids
    assert "x marked 1." in str(o.messages) and "o marked 4." in str(x.messages)
    assert "o marked" not in str(o.messages) and "x marked" not in str(x.messages)
    assert (x.env_reward, o.env_reward) == (1.0, -1.0)
    assert (x.finish, o.finish) == (Finish.ENV_DONE, Finish.ENV_DONE)
    assert (x.row["seat"], o.row["seat"]) == ("x", "o")


def test_groups_are_formed_per_row_and_seat(tokenizer):
    rows = [ROW, {**ROW, "opening": [5]}]
    moves = {"x": marks(1, 2, 3, 7, 9), "o": marks(4, 6, 8, 7, 9)}
    engine = match_engine(tokenizer, seat_script(tokenizer, moves))
    groups: list[list[int]] = []

    async def on_group(episodes):
        groups.append([e.index for e in episodes])

    episodes = anyio.run(engine.run, rows, 2, 0, on_group)
    assert [(e.group, e.index, e.row["seat"]) for e in episodes] == [
        (g, g * 2 + k, "xo"[g % 2]) for g in range(4) for k in range(2)
    ]
    assert sorted(groups) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [e.row["opening"] for e in episodes] == [[]] * 4 + [[5]] * 4


def test_an_illegal_move_loses_for_the_mover_and_is_no_win_for_the_other_seat(tokenizer):
    x, o = play(tokenizer, {"x": marks(1, 2), "o": marks(1)})  # o marks the taken cell 1
    assert (x.env_reward, o.env_reward) == (0.0, ILLEGAL_MOVE_REWARD)
    assert o.messages[-1]["content"] == "Cell 1 is taken: an illegal move, you lose."
    assert x.stats.turns == 1 and o.stats.turns == 1


def test_a_turn_without_a_move_forfeits_the_game(tokenizer):
    x, o = play(tokenizer, {"x": marks(1), "o": ["I pass."]})
    assert (x.env_reward, o.env_reward) == (0.0, ILLEGAL_MOVE_REWARD)
    assert (x.finish, o.finish) == (Finish.ENV_DONE, Finish.STOP)


def test_a_seat_cut_off_after_broken_calls_forfeits_and_one_that_moved_draws(tokenizer):
    broken = '<tool_call>{"name": "mark", "arguments": {"cell": 1</tool_call>'  # bad JSON
    x, o = play(tokenizer, {"x": marks(1) + [broken] * 4, "o": marks(5)})
    assert x.stats.tool_errors["parse"] == 4 and x.finish is o.finish is Finish.MAX_TURNS
    assert (x.env_reward, o.env_reward) == (ILLEGAL_MOVE_REWARD, 0.0)  # stalling forfeits
    unknown = tool_call("pass_turn")  # parsed, but no such tool: not a move either
    x, o = play(tokenizer, {"x": marks(1) + [unknown] * 4, "o": marks(5)})
    assert (x.env_reward, o.env_reward) == (ILLEGAL_MOVE_REWARD, 0.0)
    # Every turn a move, cut off by max_turns=1: the unfinished game's rewards, no forfeit.
    engine = MatchEngine(
        seat_script(tokenizer, {"x": marks(1, 2), "o": marks(5)}),
        tokenizer,
        environment_factory=TicTacToe,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512, max_turns=1),
    )
    x, o = anyio.run(engine.run, [ROW], 1)
    assert x.finish is o.finish is Finish.MAX_TURNS and (x.env_reward, o.env_reward) == (0.0, 0.0)


def test_a_seat_that_never_moved_still_has_its_prompt_row(tokenizer):
    x, o = play(tokenizer, {"x": ["No."], "o": marks(1)})
    assert (x.env_reward, o.env_reward) == (ILLEGAL_MOVE_REWARD, 0.0)
    [row] = o.rows
    assert row.completion_ids == [] and "You play o." in tokenizer.decode(row.prompt_ids)


def test_a_scripted_seat_is_not_trained_and_its_moves_are_reported(tokenizer):
    [x] = play(tokenizer, {"x": marks(1, 2, 3, 4, 6, 7, 8, 9)}, players={"o": "random"})
    assert x.row["seat"] == "x" and x.finish is Finish.ENV_DONE
    assert "o marked" in str(x.messages)
    again = play(tokenizer, {"x": marks(1, 2, 3, 4, 6, 7, 8, 9)}, players={"o": "random"})
    assert again[0].messages == x.messages  # the random player draws from the match's seed


def test_the_seat_contract_is_checked():
    check_environment(TicTacToe)
    assert tool_names(TicTacToe) == ["mark"]

    class NoSeats(TicTacToe):
        seats = ("x",)

    class NoObserve(TicTacToe):
        observe = None

    class SeatlessReward(TicTacToe):
        def reward(self):
            return 0.0

    for cls, words in (
        (NoSeats, "two or more distinct seat names"),
        (NoObserve, "def observe(self, seat: str)"),
        (SeatlessReward, "def reward(self, seat: str) -> float"),
    ):
        with pytest.raises(EnvironmentSpecError, match=re.escape(words)):
            check_environment(cls)


def test_seat_players_refuse_what_cannot_play():
    assert seat_players(TicTacToe, None) == {"x": None, "o": None}
    for players, words in (
        ({"z": "random"}, "names ['z']"),
        ({"o": "chess-master"}, "is not a player; use 'policy'"),
        ({"o": "snapshot:0"}, "a whole number of 1 or more"),
        ({"x": "random", "o": "random"}, "no seat is trained"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            seat_players(TicTacToe, players)


def test_good_moves_win_block_and_take_the_centre():
    rng = random.Random(0)
    assert good_move(["x", "x", "", "", "", "", "", "", ""], "x", rng) == 3
    assert good_move(["o", "o", "", "", "", "", "", "", ""], "x", rng) == 3
    assert good_move([""] * 9, "o", rng) == 5


def test_the_demonstrations_train_every_move(tokenizer):
    assert_demonstrations_train_every_call(tokenizer, TicTacToe)
    for conversation in TicTacToe.demonstrations(6, seed=1):
        assert "You play" in conversation[0]["content"]
        results = [m["content"] for m in conversation if m["role"] == "tool"]
        assert all(result.startswith("You marked") for result in results)  # no illegal move


class BadReward(TicTacToe):
    def reward(self, seat):
        return "a win"


class WrongSeat(TicTacToe):
    def to_move(self):
        return "z"


@pytest.mark.parametrize(
    ("game", "words"),
    [
        (BadReward, "BadReward.reward('x') returned 'a win'; it must return a finite number"),
        (WrongSeat, "WrongSeat.to_move() returned 'z'; it must return one of its seats"),
    ],
)
def test_a_game_that_breaks_the_contract_while_playing_stops_the_run_naming_it(
    tokenizer, game, words
):
    backend = seat_script(tokenizer, {"x": marks(1, 2, 3), "o": marks(4, 5)})
    engine = MatchEngine(
        backend, tokenizer, environment_factory=game, chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512, max_turns=5),
    )  # fmt: skip
    with pytest.raises(EnvironmentSpecError, match=re.escape(words)):
        anyio.run(engine.run, [ROW])
