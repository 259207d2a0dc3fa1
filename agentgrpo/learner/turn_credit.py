"""Credit per turn: advantages for each sampled turn of an episode instead of one per episode.

GRPO gives every token of an episode the episode's advantage. With rewards per turn (an
environment's ``turn_reward``) and long episodes, a turn can be credited with what followed it:

- ``"return"``: a turn's discounted return-to-go, ``G_t = r_t + gamma * G_(t+1)`` (the episode's
  reward added to its last turn's), normalised against the returns of the group's episodes at
  the same turn index: ``(G_t - mean_t) / (std_t + eps)`` (centred only with ``scale="none"``).
- ``"same_state"`` (GiGPO, arXiv 2505.10978): the episode's advantage, plus ``weight`` times a
  step advantage that compares the turns of a group which start from the same state:
  ``(G_t - mean_S) / (std_S + eps)`` over those turns; a state met once adds nothing.

Shapes: ``returns_N_T`` holds one row per episode and one column per turn, NaN past an
episode's last turn and for episodes left out of the baseline (a NaN reward); ``states_N_T``
holds an integer per turn naming its state (equal integers, equal states), -1 where there is
no turn or no state. Groups are contiguous runs of ``num_generations`` episodes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from agentgrpo.learner.advantages import STD_EPS, nanstd

TURN_ADVANTAGES = ("episode", "return", "same_state")


def discounted_returns(turn_rewards: Sequence[float], reward: float, gamma: float) -> list[float]:
    """Each turn's return-to-go: its reward and the later ones discounted, the episode's last.

    Examples:
        >>> discounted_returns([0.0, 1.0, 0.0], reward=2.0, gamma=0.5)
        [1.0, 2.0, 2.0]
        >>> discounted_returns([], reward=1.0, gamma=0.9)
        []

    """
    returns, following = [], 0.0
    for t in reversed(range(len(turn_rewards))):
        final = reward if t == len(turn_rewards) - 1 else 0.0
        following = turn_rewards[t] + final + gamma * following
        returns.append(following)
    return returns[::-1]


def return_advantages(
    returns_N_T: torch.Tensor, num_generations: int, scale: bool = True
) -> torch.Tensor:
    """advantages_N_T: each turn's return against the group's returns at the same turn index.

    A turn index that only one episode of its group reached has no baseline there: 0.

    Examples:
        >>> nan = float("nan")
        >>> returns = torch.tensor([[1.0, 2.0], [3.0, nan], [0.0, 0.0], [0.0, 0.0]])
        >>> return_advantages(returns, 2, scale=False).tolist()
        [[-1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]

    """
    groups_M_G_T = returns_N_T.view(-1, num_generations, returns_N_T.shape[-1])
    count_M_1_T = (~groups_M_G_T.isnan()).sum(1, keepdim=True)
    centred_M_G_T = groups_M_G_T - groups_M_G_T.nanmean(1, keepdim=True)
    if scale:
        centred_M_G_T = centred_M_G_T / (nanstd(groups_M_G_T, 1, keepdim=True) + STD_EPS)
    centred_M_G_T = centred_M_G_T.masked_fill(count_M_1_T < 2, 0.0)
    return centred_M_G_T.nan_to_num(0.0).view_as(returns_N_T)


def same_state_advantages(
    returns_N_T: torch.Tensor,
    states_N_T: torch.Tensor,
    advantages_N: torch.Tensor,
    num_generations: int,
    weight: float = 1.0,
    scale: bool = True,
) -> torch.Tensor:
    """advantages_N_T: the episode's advantage plus `weight` times the same-state step advantage.

    Examples:
        >>> nan = float("nan")
        >>> returns = torch.tensor([[1.0, 1.0], [0.0, nan]])
        >>> states = torch.tensor([[7, 8], [7, -1]])
        >>> advantages = torch.tensor([0.5, -0.5])
        >>> same_state_advantages(returns, states, advantages, 2, scale=False).tolist()
        [[1.0, 0.5], [-1.0, 0.0]]

    """
    step_N_T = torch.zeros_like(returns_N_T)
    for start in range(0, returns_N_T.shape[0], num_generations):
        members: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for n in range(start, start + num_generations):
            for t in range(returns_N_T.shape[1]):
                if states_N_T[n, t] >= 0 and not returns_N_T[n, t].isnan():
                    members[int(states_N_T[n, t])].append((n, t))
        for cells in members.values():
            if len(cells) > 1:
                _compare(returns_N_T, step_N_T, cells, scale)
    exists_N_T = ~returns_N_T.isnan()  # a turn without a state keeps the episode's advantage
    return torch.where(exists_N_T, advantages_N.unsqueeze(-1) + weight * step_N_T, 0.0)


def _compare(
    returns_N_T: torch.Tensor, step_N_T: torch.Tensor, cells: list[tuple[int, int]], scale: bool
) -> None:
    """Write into `step_N_T` the advantage of each of `cells` against the others' returns."""
    rows, columns = zip(*cells, strict=True)
    values = returns_N_T[list(rows), list(columns)]
    centred = values - values.mean()
    if scale:
        centred = centred / (values.std() + STD_EPS)
    step_N_T[list(rows), list(columns)] = centred


def turn_advantages(
    mode: str,
    returns_N_T: torch.Tensor,
    states_N_T: torch.Tensor,
    advantages_N: torch.Tensor,
    num_generations: int,
    scale: bool = True,
) -> torch.Tensor:
    """advantages_N_T for `mode` (``"return"`` or ``"same_state"``; see the module docstring)."""
    if mode == "return":
        return return_advantages(returns_N_T, num_generations, scale)
    if mode == "same_state":
        return same_state_advantages(
            returns_N_T, states_N_T, advantages_N, num_generations, scale=scale
        )
    raise ValueError(f"turn_advantage={mode!r}: use one of {list(TURN_ADVANTAGES)}")
