"""TextArena's games of two or more players with seats (`ta:GAME_ID`, no ``opponent=``), on real
games."""

from __future__ import annotations

import re

import anyio
import pytest

from agentgrpo import GRPOTrainer
from agentgrpo.doctor import Setup, Status, check_environment_runs
from agentgrpo.reporting import view_data
from environments import EnvironmentSpecError, check_environment, resolve_environment
from environments.gym_adapter import GymEnvironment
from environments.seats import ILLEGAL_MOVE_REWARD
from rollout import EpisodeConfig, Finish, ScriptedBackend, load_template
from rollout.match import MatchEngine
from tests.support.episodes import tool_call
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import short_run_config

pytest.importorskip("textarena")
SEATED = "ta:TicTacToe-v0"
THREE = "ta:ThreePlayerTicTacToe-v0"  # 5x5, four in a row, players 0, 1 and 2
FIRST = "first free"  # a scripted turn: the lowest cell the seat was last shown as available


def first_free(env, seat, rng) -> None:
    """A scripted player: the lowest free cell (the newest board's first bracketed move)."""
    env.move(**env.legal_moves()[0]["arguments"])


def ta_script(tokenizer, moves: dict[str, list[str]]) -> ScriptedBackend:
    """Seat s's k-th turn plays moves[s][k] (`FIRST`: the first move its last board offers)."""
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        text = tokenizer.decode(context)
        seat = "player_" + re.search(r"You are Player (\d)", text).group(1)
        move = moves[seat][text.count("<|im_start|>assistant\n") - 1]
        if move == FIRST:
            move = re.findall(r"Available Moves: '\[(\d)\]'", text)[-1]
        return tokenizer.encode(tool_call("move", action=move), add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos])


def play(tokenizer, moves, players=None, seat_backends=None, spec=SEATED) -> list:
    cls = resolve_environment(spec)
    engine = MatchEngine(
        ta_script(tokenizer, moves),
        tokenizer,
        environment_factory=cls,
        players=players,
        seat_backends=seat_backends,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=4096, max_turns=6),
    )
    return anyio.run(engine.run, [cls.dataset("eval")[0]], 1)


def test_a_two_player_game_without_an_opponent_meets_the_seat_contract():
    cls = resolve_environment(SEATED)
    check_environment(cls)
    assert cls.seats == ("player_0", "player_1") and resolve_environment(SEATED) is cls
    assert issubclass(resolve_environment(f"{SEATED},opponent=random"), GymEnvironment)
    env = cls()
    env.reset(seed=3)
    assert env.to_move() == "player_0"
    assert env.observe("player_0").startswith("You are Player 0 in Tic Tac Toe.")
    assert len(env.legal_moves()) == 9
    shown = env.move("4")
    assert "cell 4" in shown and env.to_move() == "player_1"
    told = env.observe("player_1")
    assert told.startswith("You are Player 1") and "[Player 0] [4]" in told
    assert told.count("Current Board") == 1 and env.observe("player_1") is None
    assert {"name": "move", "arguments": {"action": "[4]"}} not in env.legal_moves()


def test_doctor_says_player_0_moves_first(tokenizer):
    setup = Setup(tokenizer, load_template(tokenizer, "chatml_tools"), frozenset({0}))
    cls = resolve_environment(SEATED)
    result = check_environment_runs(cls, lambda: [cls.dataset("eval")[0]], setup)
    assert result.status is Status.OK, result.line()
    assert "seats player_0, player_1: player_0 moves first and is told" in result.message


def test_self_play_gives_each_seat_its_textarena_reward(tokenizer):
    first = [FIRST] * 5  # 0, 2, 4, 6 for player 0 and 1, 3, 5 for player 1: 2-4-6 wins
    zero, one = play(tokenizer, {"player_0": first, "player_1": first})
    assert [e.row["seat"] for e in (zero, one)] == ["player_0", "player_1"]
    assert (zero.env_reward, one.env_reward) == (1.0, -1.0)
    assert zero.finish is one.finish is Finish.ENV_DONE
    assert (zero.stats.turns, one.stats.turns) == (4, 3)


def test_a_snapshot_seat_samples_its_own_turns_and_gives_no_episode(tokenizer):
    snapshot = ta_script(tokenizer, {"player_1": [FIRST] * 5})
    policy = {"player_0": [FIRST] * 5}
    [zero] = play(tokenizer, policy, {"player_1": "snapshot"}, {"player_1": snapshot})
    assert zero.row["seat"] == "player_0" and zero.env_reward == 1.0


def test_a_scripted_opponent_seat_plays_its_moves_and_loses(tokenizer):
    scripted = "tests.environments.test_textarena_seats:first_free"  # takes 0, 1, 3
    [zero] = play(tokenizer, {"player_0": ["4", "8", "2", "6"]}, {"player_1": scripted})
    assert zero.env_reward == 1.0 and zero.finish is Finish.ENV_DONE
    assert "Player 0 has won!" in zero.messages[-1]["content"]


def test_a_random_opponent_seat_plays_to_the_end_with_zero_sum_rewards(tokenizer):
    [zero] = play(tokenizer, {"player_0": [FIRST] * 5}, {"player_1": "random"})
    state = zero.environment._game.state
    assert state.done and zero.finish is Finish.ENV_DONE
    assert zero.env_reward == float(state.rewards[0]) == -float(state.rewards[1])
    assert zero.env_reward == zero.environment.reward("player_0")


def test_an_illegal_move_costs_the_mover_and_never_wins_the_other_seat(tokenizer):
    zero, one = play(tokenizer, {"player_0": ["4"], "player_1": ["4", "4"]})
    assert (zero.env_reward, one.env_reward) == (0.0, ILLEGAL_MOVE_REWARD)
    retry, lost = (m["content"] for m in one.messages if m["role"] == "tool")
    assert retry.startswith("Illegal move.\n") and "cell 4 is already occupied" in retry
    assert lost.startswith("Illegal move. The game is over")


def test_a_three_player_game_has_three_seats_each_with_its_own_reward(tokenizer):
    cls = resolve_environment(THREE)
    check_environment(cls)
    assert cls.seats == ("player_0", "player_1", "player_2")
    assert resolve_environment(f"{THREE},players=3") is not cls  # its own spec, same seats
    # player_0 fills row 0 (cells 0-3: four in a row) while the others play rows 1 and 2
    moves = {
        "player_0": ["0", "1", "2", "3"],
        "player_1": ["5", "6", "7"],
        "player_2": ["10", "11", "12"],
    }
    episodes = play(tokenizer, moves, spec=THREE)
    assert [e.row["seat"] for e in episodes] == ["player_0", "player_1", "player_2"]
    state = episodes[0].environment._game.state
    assert state.done and all(e.finish is Finish.ENV_DONE for e in episodes)
    assert [e.env_reward for e in episodes] == [float(state.rewards[p]) for p in range(3)]
    assert episodes[0].env_reward == 1.0 > max(e.env_reward for e in episodes[1:])
    assert [e.stats.turns for e in episodes] == [4, 3, 3]
    cells = {"player_0": [str(cell) for cell in range(25)]}  # turn k: cell k, taken or not
    [zero] = play(tokenizer, cells, {"player_1": "random", "player_2": "random"}, spec=THREE)
    info = zero.environment._game.state.game_info  # cut off at max_turns=6, or over before
    assert zero.row["seat"] == "player_0" and zero.finish in (Finish.ENV_DONE, Finish.MAX_TURNS)
    assert info[1]["turn_count"] >= 1 and info[2]["turn_count"] >= 1  # the random seats moved


def test_players_picks_the_count_and_an_opponent_needs_two_players():
    assert resolve_environment("ta:Poker-v0").seats == ("player_0", "player_1")  # the fewest
    assert len(resolve_environment("ta:Poker-v0,players=12").seats) == 12  # past the 8 tried
    with pytest.raises(EnvironmentSpecError, match="does not start with players=3"):
        resolve_environment(f"{SEATED},players=3")
    with pytest.raises(EnvironmentSpecError, match="must be a whole number >= 1"):
        resolve_environment(f"{SEATED},players=two")
    with pytest.raises(EnvironmentSpecError, match="is played by 3 players; opponent= plays"):
        resolve_environment(f"{THREE},opponent=random")


def test_one_grpo_step_trains_player_0_against_random_moves(tmp_path, tokenizer):
    cls = resolve_environment(SEATED)
    args = short_run_config(
        tmp_path, max_steps=1, num_generations=2, max_completion_length=96, max_turns=3,
        chat_template="chatml_tools", log_episodes=True, seat_players={"player_1": "random"},
    )  # fmt: skip
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        None,
        args,
        cls.dataset("train").select(range(2)),
        processing_class=tokenizer,
        environment_factory=cls,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    records, problems = view_data.read_step(tmp_path, 1)
    assert not problems and [view_data.episode_view(r)["seat"] for r in records] == ["player_0"] * 4
