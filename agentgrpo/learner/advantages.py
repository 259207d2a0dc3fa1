"""Group-relative advantages: how much better each episode did than its siblings.

GRPO samples G episodes per task (a *group*) and scores each one. An episode's advantage is its
reward minus the mean reward of its group, optionally divided by a spread. No value network: the
group itself is the baseline.

Shapes: N episodes in a batch, laid out as N // G groups of G contiguous episodes (episodes
``[0, G)`` are the first task's group, ``[G, 2G)`` the second's, ...). Internally a batch is viewed
as ``groups_M_G`` with M = N // G groups. F is the number of reward functions.

Everything here is a pure function of tensors; it imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Added to every standard deviation before dividing, so a group whose rewards are all equal
# (std 0) gets advantage 0 instead of a division by zero.
STD_EPS = 1e-4


def _as_groups(rewards_N: torch.Tensor, num_generations: int) -> torch.Tensor:
    """View a flat batch as ``groups_M_G``, checking that it splits into whole groups."""
    if rewards_N.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D (one per episode), got shape {tuple(rewards_N.shape)}"
        )
    if num_generations < 2:
        raise ValueError(
            f"num_generations must be >= 2 (a group of one has no baseline), got {num_generations}"
        )
    if rewards_N.numel() % num_generations:
        raise ValueError(
            f"{rewards_N.numel()} rewards do not split into groups of {num_generations}: "
            "the batch must hold whole groups, contiguous"
        )
    return rewards_N.view(-1, num_generations)


def nanstd(values: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """The unbiased (n - 1) std of the non-NaN entries along `dim`; NaN where fewer than two.

    Examples:
        >>> nanstd(torch.tensor([[1.0, 3.0, float("nan")], [2.0, float("nan"), float("nan")]]), 1)
        tensor([1.4142,    nan])

    """
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    centred = values - values.nanmean(dim=dim, keepdim=True)
    variance = centred.square().nansum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, variance.sqrt(), float("nan"))
    return std if keepdim else std.squeeze(dim)


def group_std(rewards_N: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Unbiased standard deviation of the rewards within each group, NaN rewards left out.

    The trainer logs the fraction of groups whose std is 0 (``frac_reward_zero_std``): such a
    group teaches nothing, since every advantage in it is 0.

    Args:
        rewards_N: One reward per episode, shape (N,), groups contiguous; NaN for an episode no
            reward function scored.
        num_generations: Group size G (>= 2); N must be a multiple of it.

    Returns:
        std_M: One std per group, shape (N // G,); the (n - 1) estimator over the group's
        non-NaN rewards, NaN where it has fewer than two (as TRL's ``nanstd``).

    Examples:
        >>> group_std(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2).tolist()
        [0.0, 1.4142135381698608]

    """
    return nanstd(_as_groups(rewards_N, num_generations), dim=1)


def _scale_by_group(centred_M_G: torch.Tensor, groups_M_G: torch.Tensor) -> torch.Tensor:
    return centred_M_G / (nanstd(groups_M_G, dim=1, keepdim=True) + STD_EPS)


def _scale_by_batch(centred_M_G: torch.Tensor, groups_M_G: torch.Tensor) -> torch.Tensor:
    return centred_M_G / (nanstd(groups_M_G.reshape(-1), dim=0) + STD_EPS)


def _no_scale(centred_M_G: torch.Tensor, groups_M_G: torch.Tensor) -> torch.Tensor:
    return centred_M_G


_SCALES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "group": _scale_by_group,
    "batch": _scale_by_batch,
    "none": _no_scale,
}


def group_advantages(
    rewards_N: torch.Tensor, num_generations: int, scale: str = "group"
) -> torch.Tensor:
    """Advantage of each episode: its reward minus its group's mean, optionally scaled.

    Args:
        rewards_N: One reward per episode, shape (N,), groups of ``num_generations`` contiguous.
            NaN marks an episode no reward function scored: as in TRL 1.16, it is left out of
            its group's mean and of every std, and its advantage is 0. Other rewards must be
            finite.
        num_generations: Group size G; N must be a multiple of it. G = 1 (TRL allows it for
            evaluation, `num_generations_eval=1`) gives every episode advantage 0: a group of
            one has no baseline. Training needs G >= 2 (`GRPOConfig` checks it).
        scale: What to divide the centred rewards by.
            ``"group"``: the group's std + 1e-4 (unit spread within each group; GRPO).
            ``"batch"``: the std of all N rewards + 1e-4 (PPO Lite).
            ``"none"``: nothing (Dr. GRPO: a per-group std weights easy and hard tasks unequally).
            Stds are unbiased (n - 1), as ``torch.std``; a group (or batch) with fewer than two
            scored episodes has no spread, and its advantages are 0.

    Returns:
        advantages_N: Shape (N,), same order as ``rewards_N``; never NaN.

    Raises:
        ValueError: On an unknown ``scale`` or a batch that is not whole groups.

    Examples:
        >>> group_advantages(torch.tensor([1.0, 0, 0, 1]), 4, scale="none").tolist()
        [0.5, -0.5, -0.5, 0.5]
        >>> group_advantages(torch.tensor([1.0, float("nan"), 0, 2]), 4, scale="none").tolist()
        [0.0, 0.0, -1.0, 1.0]

    """
    if scale not in _SCALES:
        raise ValueError(f"unknown scale {scale!r}; expected one of {sorted(_SCALES)}")
    if num_generations == 1 and rewards_N.dim() == 1:
        return torch.zeros_like(rewards_N)  # a group of one has no baseline: no signal
    groups_M_G = _as_groups(rewards_N, num_generations)
    centred_M_G = groups_M_G - groups_M_G.nanmean(dim=1, keepdim=True)
    advantages_N = _SCALES[scale](centred_M_G, groups_M_G).reshape(-1)
    return advantages_N.masked_fill(advantages_N.isnan(), 0.0)


def _normalise_within_groups(rewards_N_F: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Centre and scale each reward column within each group, ignoring NaN entries.

    Mean and unbiased std are taken over the non-NaN entries of a (group, function) cell; a cell
    with fewer than two such entries has std 0, so its lone entry becomes 0. NaNs stay NaN.
    """
    num_functions = rewards_N_F.shape[1]
    groups_M_G_F = rewards_N_F.view(-1, num_generations, num_functions)
    valid_M_G_F = ~groups_M_G_F.isnan()
    count_M_1_F = valid_M_G_F.sum(dim=1, keepdim=True)
    mean_M_1_F = groups_M_G_F.nansum(dim=1, keepdim=True) / count_M_1_F.clamp(min=1)
    centred_M_G_F = groups_M_G_F - mean_M_1_F
    squares_M_G_F = torch.where(valid_M_G_F, centred_M_G_F.square(), 0.0)
    var_M_1_F = squares_M_G_F.sum(dim=1, keepdim=True) / (count_M_1_F - 1).clamp(min=1)
    return (centred_M_G_F / (var_M_1_F.sqrt() + STD_EPS)).view(-1, num_functions)


def combine_rewards(
    rewards_N_F: torch.Tensor,
    weights_F: torch.Tensor | Sequence[float],
    num_generations: int,
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """One reward per episode from F reward functions, as a weighted sum.

    NaN means "this function does not apply to this episode": it is left out of the sum (not
    counted as 0 in a mean, not spread to the other functions).

    Args:
        rewards_N_F: Reward of episode n from function f, shape (N, F), groups contiguous.
        weights_F: One weight per function, length F.
        num_generations: Group size G; used by ``"normalize_then_sum"`` (N must be a multiple).
        aggregation: ``"sum_then_normalize"``: the weighted sum of the raw rewards; the caller
            then normalises it with :func:`group_advantages`. ``"normalize_then_sum"`` (GDPO):
            each function's column is first normalised within each group (minus the group mean,
            over the group std + 1e-4, both over the non-NaN entries), then weighted and summed.
            GDPO then scales the sum over the whole batch: ``group_advantages(..., "batch")``.

    Returns:
        rewards_N: Shape (N,). NaN exactly where every function gave NaN, so the trainer can
        report the episode instead of training on a made-up reward.

    Examples:
        >>> nan = float("nan")
        >>> combine_rewards(torch.tensor([[1.0, nan], [nan, nan]]), [1.0, 2.0], 2).tolist()
        [1.0, nan]

    """
    if rewards_N_F.dim() != 2:
        raise ValueError(f"rewards must be (N, F), got shape {tuple(rewards_N_F.shape)}")
    weights_F = torch.as_tensor(weights_F, dtype=rewards_N_F.dtype, device=rewards_N_F.device)
    if weights_F.shape != rewards_N_F.shape[1:]:
        raise ValueError(f"{weights_F.numel()} weights for {rewards_N_F.shape[1]} reward functions")
    if aggregation == "normalize_then_sum":
        _as_groups(rewards_N_F[:, 0], num_generations)  # the same whole-groups check
        rewards_N_F = _normalise_within_groups(rewards_N_F, num_generations)
    elif aggregation != "sum_then_normalize":
        raise ValueError(
            f"unknown aggregation {aggregation!r}; "
            "expected 'sum_then_normalize' or 'normalize_then_sum'"
        )
    combined_N = (rewards_N_F * weights_F).nansum(dim=1)
    return combined_N.masked_fill(rewards_N_F.isnan().all(dim=1), float("nan"))
