"""Who plays a seat: a frozen snapshot's own backend, seats that sat out, engines that refuse."""

from __future__ import annotations

import re

import anyio
import pytest

from environments.seats import Snapshot, seat_players
from environments.tictactoe import TicTacToe
from rollout import EpisodeConfig, RolloutEngine, ScriptedBackend
from rollout.match import MatchEngine, sat_out
from tests.rollout.test_match import ROW, marks, play, seat_script


def snapshot_engine(tokenizer, policy, seat_backends, players=None, **options) -> MatchEngine:
    return MatchEngine(
        policy, tokenizer, environment_factory=TicTacToe, chat_template="chatml_tools",
        players={"o": "snapshot"} if players is None else players,
        seat_backends=seat_backends,
        config=EpisodeConfig(max_completion_length=512, max_turns=5, temperature=0.7),
        **options,
    )  # fmt: skip


def test_snapshot_players_are_parsed_with_their_refresh_period():
    assert seat_players(TicTacToe, {"o": "snapshot"}) == {"x": None, "o": Snapshot()}
    assert seat_players(TicTacToe, {"x": "snapshot:3"})["x"] == Snapshot(every=3)
    assert seat_players(TicTacToe, {"o": "league:10:4"})["o"] == Snapshot(every=10, pool=4)
    for player in ("snapshot:x", "snapshot:-1", "snapshot:", "league:10", "league:10:1"):
        with pytest.raises(ValueError, match=re.escape("a whole number of 1 or more")):
            seat_players(TicTacToe, {"o": player})
    with pytest.raises(ValueError, match="no seat is trained"):
        seat_players(TicTacToe, {"x": "snapshot", "o": "random"})


def test_a_snapshot_seat_samples_from_its_own_backend_and_gives_no_episode(tokenizer):
    # The policy's script knows only x's moves: a turn of o asked of it would fail.
    policy = seat_script(tokenizer, {"x": marks(1, 2, 3)})
    snapshot = seat_script(tokenizer, {"o": marks(4, 5)})
    engine = snapshot_engine(tokenizer, policy, {"o": snapshot})
    assert engine.trained_seats == ["x"]
    [x] = anyio.run(engine.run, [ROW], 1)
    assert x.row["seat"] == "x" and x.env_reward == 1.0
    assert "o marked 4." in str(x.messages) and "o marked 5." in str(x.messages)


def test_a_snapshot_seat_samples_at_its_own_temperature_and_the_policy_at_the_runs(tokenizer):
    policy = seat_script(tokenizer, {"x": marks(1, 2, 3)})
    snapshot = seat_script(tokenizer, {"o": marks(4, 5)})
    engine = snapshot_engine(tokenizer, policy, {"o": snapshot}, seat_temperatures={"o": 0})
    [x] = anyio.run(engine.run, [ROW], 1)
    assert x.env_reward == 1.0
    assert [params.temperature for _, params in policy.requests] == [0.7] * 3
    assert [params.temperature for _, params in snapshot.requests] == [0.0] * 2
    for seats in ({"x": 0.0}, {"o": 0.0, "x": 1.0}):
        with pytest.raises(ValueError, match=re.escape("a policy seat's turns are trained")):
            snapshot_engine(tokenizer, policy, {"o": snapshot}, seat_temperatures=seats)


def test_each_snapshot_seat_needs_its_backend_and_no_other_seat_has_one(tokenizer):
    policy = seat_script(tokenizer, {"x": marks(1)})
    for backends, words in (
        (None, "backends for seats [], but the seats a snapshot plays are ['o']"),
        ({"x": policy}, "backends for seats ['x'], but the seats a snapshot plays are ['o']"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            snapshot_engine(tokenizer, policy, backends)
    with pytest.raises(ValueError, match=re.escape("backends for seats ['o']")):
        snapshot_engine(tokenizer, policy, {"o": policy}, players={"o": "random"})
    empty = snapshot_engine(tokenizer, policy, {"o": []})  # a pool no round has filled yet
    with pytest.raises(ValueError, match="no snapshot of the policy has been taken yet"):
        anyio.run(empty.run, [ROW])


def test_a_plain_engine_refuses_a_game_with_seats_at_once(tokenizer):
    backend = ScriptedBackend(lambda ids: [tokenizer.eos_token_id], [tokenizer.eos_token_id])
    for factory in (TicTacToe, {"game": TicTacToe}):
        with pytest.raises(ValueError, match=re.escape("use rollout.match.MatchEngine")):
            RolloutEngine(backend, tokenizer, environment_factory=factory)


def test_a_seat_whose_game_ended_before_its_turn_sat_out(tokenizer):
    x, o = play(tokenizer, {"x": ["No."], "o": marks(1)})
    assert sat_out(o) and not sat_out(x)
    played_x, played_o = play(tokenizer, {"x": marks(1, 2, 3), "o": marks(4, 5)})
    assert not sat_out(played_x) and not sat_out(played_o)


def test_each_game_draws_its_snapshot_from_a_league_pool(tokenizer):
    policy = seat_script(tokenizer, {"x": marks(1, 2, 3)})
    old, older = (
        seat_script(tokenizer, {"o": marks(4, 5)}),
        seat_script(tokenizer, {"o": marks(7, 8)}),
    )
    engine = snapshot_engine(tokenizer, policy, {"o": [old, older]}, {"o": "league:1:2"})
    episodes = anyio.run(engine.run, [ROW], 8)
    opponents = ["o marked 4." in str(x.messages) for x in episodes]
    assert all(x.env_reward == 1.0 for x in episodes) and set(opponents) == {True, False}
    assert [e.messages for e in anyio.run(engine.run, [ROW], 8)] == [e.messages for e in episodes]
