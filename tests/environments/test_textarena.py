"""TextArena's games by id (`ta:GAME_ID`), played against the real textarena package."""

from __future__ import annotations

import anyio
import pytest

from environments import EnvironmentSpecError, check_environment, class_tools, resolve_environment
from environments.contract import episode_limits
from rollout import Finish
from tests.support.episodes import chatml_engine, scripted_backend, tool_call

pytest.importorskip("textarena")
GUESS = "ta:GuessTheNumber-v0"  # 1 to 20, 10 guesses
TICTACTOE = "ta:TicTacToe-v0,opponent=first"  # the opponent takes the lowest free cell
WIN = ["4", "8", "2", "6"]  # against `first` (0, 1, 3): the diagonal 2-4-6


def always_off_the_board(observation: str) -> str:
    """An opponent whose every move is illegal in TicTacToe."""
    return "[9]"


def secret(env) -> int:
    return env.env.game.state.game_state["game_number"]


def test_a_game_id_meets_the_contract_with_one_move_tool():
    cls = resolve_environment(TICTACTOE)
    check_environment(cls)
    schema = class_tools(cls)["move"].schema["function"]["parameters"]
    assert schema["properties"]["action"]["type"] == "string"
    assert episode_limits(cls)["max_turns"] == 20
    assert resolve_environment(TICTACTOE) is cls


def test_a_single_player_game_is_won_by_guessing_the_number():
    env = resolve_environment(GUESS)()
    assert "Guess The Number" in env.reset(seed=1)
    number = secret(env)
    wrong = 1 if number != 1 else 2
    shown = env.move(str(wrong))
    assert "higher" in shown or "lower" in shown
    assert not env.done and env.reward() == 0.0
    assert "Congratulations" in env.move(f"[{number}]")
    assert env.done and env.terminated and env.reward() == 1.0
    env.close()


def test_tictactoe_is_won_against_the_first_move_opponent_and_each_turn_shows_only_news():
    env = resolve_environment(TICTACTOE)()
    first = env.reset(seed=0)
    assert first.startswith("You are Player 0 in Tic Tac Toe.")
    shown = [env.move(cell) for cell in WIN]
    assert "[Player 1] [0]" in shown[0] and "[Player 1] [1]" in shown[1]
    for text in shown[:3]:
        assert "You are Player 0" not in text  # the prompt is not repeated
        assert text.count("Current Board") == 1  # of the boards since, the last one
        assert "[Player 0]" not in text  # nor the model's own move
    assert "Player 0 has won!" in shown[-1]
    assert env.done and env.terminated and env.reward() == 1.0
    env.close()


def test_an_illegal_model_move_is_reported_and_scored_as_textarena_scores_it():
    env = resolve_environment(TICTACTOE)()
    env.reset(seed=0)
    env.move("4")
    retry = env.move("4")  # occupied: TextArena allows one retry (error_allowance=1)
    assert retry.startswith("Illegal move.") and "cell 4 is already occupied" in retry
    assert not env.done and env.env.illegal_moves == 1
    lost = env.move("[4]")
    assert lost.startswith("Illegal move. The game is over")
    assert env.done and env.reward() == 0.0  # TextArena's -1, a loss
    env.close()


def test_an_illegal_opponent_move_is_replaced_and_never_scored_as_a_win():
    module = "tests.environments.test_textarena:always_off_the_board"
    env = resolve_environment(f"ta:TicTacToe-v0,opponent={module}")()
    env.reset(seed=0)
    shown = env.move("4")
    assert "[Player 1] [0]" in shown and not env.done
    assert env.env.opponent_replaced == 1
    for cell in WIN[1:]:
        env.move(cell)
    assert env.done and env.reward() == 1.0  # won on the board, after three replaced moves
    assert env.env.opponent_replaced == 3
    env.close()


def test_the_random_opponent_replays_for_the_same_seed():
    cls = resolve_environment("ta:TicTacToe-v0,opponent=random")
    games = []
    for seed in (5, 5, 6, 7):
        env = cls()
        env.reset(seed=seed)
        games.append(env.move("4"))
        env.close()
    assert games[0] == games[1] and len(set(games)) > 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ta:GuessTheNumber-v0,opponent=random", "single-player game: it takes no opponent"),
        ("ta:TicTacToe-v0,opponent=best", "opponent='best' is not an opponent; use one of"),
        ("ta:TicTacToo-v0", "close matches: TicTacToe-v0"),
        ("ta:", "names no environment id"),
        ("ta:SecretMafia-v0,opponent=random", "is played by 6 players; opponent= plays"),
    ],
)
def test_bad_textarena_specs_are_spec_errors(spec, message):
    with pytest.raises(EnvironmentSpecError, match=message):
        resolve_environment(spec)


def test_a_scripted_group_wins_tictactoe_through_the_engine(tokenizer):
    cls = resolve_environment(TICTACTOE)
    row = cls.dataset("eval")[0]
    turns = [tool_call("move", action=cell) for cell in WIN] + ["never"]
    engine = chatml_engine(
        scripted_backend(tokenizer, turns), tokenizer, cls, **episode_limits(cls)
    )
    for episode in anyio.run(engine.run, [row], 2, 10):
        assert episode.finish is Finish.ENV_DONE
        assert episode.env_reward == 1.0
        assert "You are Player 0 in Tic Tac Toe." in episode.messages[0]["content"]
