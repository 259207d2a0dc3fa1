"""Credit per turn against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agentgrpo.learner.advantages import STD_EPS
from agentgrpo.learner.turn_credit import (
    discounted_returns,
    return_advantages,
    same_state_advantages,
    turn_advantages,
)
from agentgrpo.rounds.turn_credit import TurnCredit, spread, state_id
from rollout import Episode, EpisodeRow, EpisodeStats, Finish, TurnRecord

NAN = math.nan


def test_returns_discount_the_later_turns_and_add_the_episode_reward_last():
    # G_2 = 0.5 + 1, G_1 = 0 + 0.9 * 1.5, G_0 = 1 + 0.9 * 1.35
    assert discounted_returns([1.0, 0.0, 0.5], 1.0, 0.9) == pytest.approx([2.215, 1.35, 1.5])


def test_return_advantages_normalise_each_turn_index_within_its_group():
    returns = torch.tensor([[2.0, 1.0, 1.0], [0.0, 1.0, NAN], [1.0, 3.0, NAN], [1.0, 3.0, NAN]])
    got = return_advantages(returns, num_generations=2)
    std0, std1 = math.sqrt(2.0), 0.0  # group 0: index 0 holds 2 and 0; index 1 holds 1 and 1
    expected = [
        [1.0 / (std0 + STD_EPS), 0.0 / (std1 + STD_EPS), 0.0],  # index 2: one episode, no baseline
        [-1.0 / (std0 + STD_EPS), 0.0, 0.0],
        [0.0, 0.0, 0.0],  # group 1: equal returns
        [0.0, 0.0, 0.0],
    ]
    assert torch.allclose(got, torch.tensor(expected))


def test_same_state_adds_a_step_advantage_among_turns_from_the_same_state():
    # One group of three: turns 0 all start from state 5; turn 1 of episodes 0 and 2 from 6.
    returns = torch.tensor([[1.0, 1.0], [0.0, NAN], [2.0, 0.0]])
    states = torch.tensor([[5, 6], [5, -1], [5, 6]])
    episode = torch.tensor([0.1, -0.2, 0.3])
    got = same_state_advantages(returns, states, episode, num_generations=3, weight=0.5)
    step_5 = [(1 - 1) / (1 + STD_EPS), (0 - 1) / (1 + STD_EPS), (2 - 1) / (1 + STD_EPS)]
    step_6 = [(1 - 0.5) / (math.sqrt(0.5) + STD_EPS), (0 - 0.5) / (math.sqrt(0.5) + STD_EPS)]
    expected = [
        [0.1 + 0.5 * step_5[0], 0.1 + 0.5 * step_6[0]],
        [-0.2 + 0.5 * step_5[1], 0.0],
        [0.3 + 0.5 * step_5[2], 0.3 + 0.5 * step_6[1]],
    ]
    assert torch.allclose(got, torch.tensor(expected))


def test_an_unknown_mode_names_the_option():
    with pytest.raises(ValueError, match="turn_advantage='best'"):
        turn_advantages("best", torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2), 2)


def episode(turns: list[TurnRecord], widths: list[int]) -> Episode:
    rows = tuple(EpisodeRow([1], [2] * w, [1] * w, [0.0] * w) for w in widths)
    return Episode(
        rows, [], Finish.STOP, EpisodeStats(len(turns), 0, {}), {}, 0, 0, turns=tuple(turns)
    )


def test_each_turns_advantage_lands_on_its_own_tokens_and_the_rest_keep_the_episodes():
    played = episode([TurnRecord(0, 0, 2), TurnRecord(0, 3, 4), TurnRecord(1, 0, 3)], [5, 3])
    rows = spread(played, torch.tensor([1.0, 2.0, 3.0]), advantage=-1.0)
    assert [r.tolist() for r in rows] == [[1.0, 1.0, -1.0, 2.0, -1.0], [3.0, 3.0, 3.0]]


def test_a_round_credits_turns_from_the_turn_rewards_and_the_episode_reward():
    # Two episodes of one group: both rewarded 1 at the end; the first earned 1 on turn 0.
    first = episode([TurnRecord(0, 0, 1, reward=1.0), TurnRecord(0, 1, 2)], [2])
    second = episode([TurnRecord(0, 0, 1), TurnRecord(0, 1, 2)], [2])
    credit = TurnCredit("return", gamma=1.0, scale=False)
    rows = credit.token_advantages(
        [first, second], torch.tensor([1.0, 1.0]), torch.zeros(2), lambda t: t, 0, 2
    )
    # Returns: first [2, 1], second [1, 1]; index 0 centred on 1.5, index 1 on 1.
    assert [r.tolist() for r in rows] == [[0.5, 0.0], [-0.5, 0.0]]


def test_state_ids_are_stable_non_negative_integers():
    assert state_id("a room") == state_id("a room") != state_id("another room")
    assert 0 <= state_id("x") < 2**56
