"""Group-relative advantages and reward combination, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agentgrpo.learner.advantages import combine_rewards, group_advantages, group_std

NAN = float("nan")


def test_unscaled_advantages_are_rewards_minus_the_group_mean():
    # One group of 4, mean 0.5.
    rewards_N = torch.tensor([1.0, 0, 0, 1])
    assert group_advantages(rewards_N, 4, scale="none").tolist() == [0.5, -0.5, -0.5, 0.5]


def test_group_scaling_divides_by_each_groups_unbiased_std():
    # Group 1: [1, 0, 0, 1], mean 0.5, squared deviations 4 * 0.25 = 1, unbiased var 1/3,
    # std 0.57735; advantages +-0.5 / (0.57735 + 1e-4).
    # Group 2: [2, 2, 2, 2], std 0: every advantage 0 (the 1e-4 avoids dividing by zero).
    rewards_N = torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 2])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # 0.86588
    expected = [a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(group_advantages(rewards_N, 4), torch.tensor(expected))


def test_batch_scaling_divides_by_the_std_of_the_whole_batch():
    # Groups [1, 0] and [3, 0]: means 0.5 and 1.5, centred [0.5, -0.5, 1.5, -1.5].
    # Batch [1, 0, 3, 0]: mean 1, squared deviations 0 + 1 + 4 + 1 = 6, var 6/3 = 2, std 1.41421.
    rewards_N = torch.tensor([1.0, 0, 3, 0])
    std = math.sqrt(2) + 1e-4
    expected = [0.5 / std, -0.5 / std, 1.5 / std, -1.5 / std]
    torch.testing.assert_close(group_advantages(rewards_N, 2, "batch"), torch.tensor(expected))


def test_group_std_is_one_unbiased_std_per_group():
    # [1, 0]: mean 0.5, var (0.25 + 0.25) / 1 = 0.5, std 0.70711; [2, 2]: 0.
    std_M = group_std(torch.tensor([1.0, 0, 2, 2]), 2)
    torch.testing.assert_close(std_M, torch.tensor([math.sqrt(0.5), 0.0]))


def test_a_batch_that_is_not_whole_groups_is_refused():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)


def test_an_unknown_scale_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="'batch', 'group', 'none'"):
        group_advantages(torch.zeros(4), 2, scale="groups")


def test_sum_then_normalize_is_a_weighted_sum_that_skips_nan():
    # Weights [1, 0.5]. Row 0: 1*1 + (NaN skipped) = 1. Row 1: every function NaN -> NaN.
    # Row 2: 0*1 + 2*0.5 = 1. Row 3: 1*1 + 1*0.5 = 1.5.
    rewards_N_F = torch.tensor([[1.0, NAN], [NAN, NAN], [0.0, 2.0], [1.0, 1.0]])
    combined_N = combine_rewards(rewards_N_F, [1.0, 0.5], num_generations=2)
    torch.testing.assert_close(combined_N, torch.tensor([1.0, NAN, 1.0, 1.5]), equal_nan=True)


def test_normalize_then_sum_normalises_each_function_within_each_group_first():
    # Weights [1, 2], groups of 2.
    # Group 1, function 0: [1, 0], mean 0.5, std sqrt(0.5) -> +-0.5 / (0.70711 + 1e-4) = +-a.
    # Group 1, function 1: [0, NaN]: one valid entry, centred to 0 (std taken as 0); NaN stays.
    #   Row 0 = a + 2*0 = a; row 1 = -a + (NaN skipped) = -a.
    # Group 2, function 0: [2, 4] -> -+1 / (sqrt(2) + 1e-4) = -+b; function 1: [4, 2] -> +-b.
    #   Row 2 = -b + 2b = b; row 3 = b - 2b = -b.
    rewards_N_F = torch.tensor([[1.0, 0.0], [0.0, NAN], [2.0, 4.0], [4.0, 2.0]])
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    b = 1.0 / (math.sqrt(2) + 1e-4)
    combined_N = combine_rewards(rewards_N_F, [1.0, 2.0], 2, aggregation="normalize_then_sum")
    torch.testing.assert_close(combined_N, torch.tensor([a, -a, b, -b]))


def test_normalize_then_sum_keeps_an_all_nan_row_nan():
    rewards_N_F = torch.tensor([[1.0, 3.0], [NAN, NAN]])
    combined_N = combine_rewards(rewards_N_F, [1.0, 1.0], 2, aggregation="normalize_then_sum")
    # Row 0 is alone in each column: centred to 0 + 0 = 0.
    torch.testing.assert_close(combined_N, torch.tensor([0.0, NAN]), equal_nan=True)


def test_a_weight_count_that_does_not_match_the_functions_is_refused():
    with pytest.raises(ValueError, match="3 weights for 2 reward functions"):
        combine_rewards(torch.zeros(2, 2), [1.0, 1.0, 1.0], 2)


def test_an_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="normalize_then_sum"):
        combine_rewards(torch.zeros(2, 1), [1.0], 2, aggregation="mean")


def test_a_group_of_one_has_no_baseline_so_every_advantage_is_zero():
    # TRL evaluates with num_generations_eval=1; training is refused below 2 by GRPOConfig.
    rewards_N = torch.tensor([0.3, 1.0, -2.0])
    for scale in ("group", "batch", "none"):
        assert group_advantages(rewards_N, 1, scale).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_an_unscored_episode_is_left_out_of_the_baseline_with_advantage_zero(scale):
    # As TRL 1.16: group [nan, 1, 2, 3] has mean 2 and std 1 over its scored episodes, not the
    # mean 1.5 of [0, 1, 2, 3]; the unscored episode's advantage is 0. A group with one scored
    # episode has no spread: all its advantages are 0 when scaled.
    rewards_N = torch.tensor([NAN, 1.0, 2, 3, NAN, 5, NAN, NAN])
    advantages_N = group_advantages(rewards_N, 4, scale)
    batch_std = torch.tensor([1.0, 2, 3, 5]).std().item()
    divisor = {"group": 1 + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
    expected = [0.0, -1 / divisor, 0.0, 1 / divisor, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(advantages_N, torch.tensor(expected))


def test_group_std_leaves_nan_out_and_is_nan_below_two_scored_episodes():
    std_M = group_std(torch.tensor([NAN, 1.0, 3.0, NAN, NAN, 4.0]), 3)
    assert std_M[0].item() == pytest.approx(math.sqrt(2)) and math.isnan(std_M[1].item())
