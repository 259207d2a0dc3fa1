"""Masked sums and means over the tokens of a padded batch, per row, per episode or overall.

Tensors are over completion positions: B rows, T positions. ``mask_B_T`` (bool or 0/1 float)
is 1 where a token counts; values at masked positions never reach a result (even inf or NaN).
An episode is one or more rows (``episode_B`` gives each row's episode; None: one row each).

The module imports only torch.
"""

from __future__ import annotations

import torch


def masked_sum_per_row(values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Sum over active positions of each row; masked positions contribute exactly 0."""
    return torch.where(mask_B_T != 0, values_B_T * mask_B_T, 0.0).sum(dim=-1)


def masked_mean_per_row(values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Mean over active positions of each row (0 for a row with none)."""
    return masked_sum_per_row(values_B_T, mask_B_T) / mask_B_T.sum(dim=-1).clamp(min=1)


def masked_mean(values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Mean over all active positions of the batch (0 when there are none)."""
    return masked_sum_per_row(values_B_T, mask_B_T).sum() / mask_B_T.sum().clamp(min=1)


def episode_of_rows(episode_B: torch.Tensor | None, rows: int) -> tuple[torch.Tensor, int]:
    """Each row's episode as 0..E-1, and E; None means each row is its own episode.

    >>> episode_of_rows(torch.tensor([7, 3, 7]), 3)
    (tensor([1, 0, 1]), 2)
    """
    if episode_B is None:
        return torch.arange(rows), rows
    unique_E, inverse_B = torch.unique(episode_B, return_inverse=True)
    return inverse_B, len(unique_E)


def sum_per_episode(values_B: torch.Tensor, episode_B: torch.Tensor, episodes: int):
    """values_E: the sum of each episode's rows (differentiable)."""
    sums_E = torch.zeros(episodes, dtype=values_B.dtype, device=values_B.device)
    return sums_E.index_add(0, episode_B.to(values_B.device), values_B)


def masked_sum_and_count_per_episode(
    values_B_T: torch.Tensor, mask_B_T: torch.Tensor, episode_B: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums_E, counts_E): each episode's masked sum and active-token count over all its rows."""
    index_B, episodes = episode_of_rows(episode_B, values_B_T.shape[0])
    sums_E = sum_per_episode(masked_sum_per_row(values_B_T, mask_B_T), index_B, episodes)
    counts_E = sum_per_episode(mask_B_T.sum(dim=-1).to(values_B_T.dtype), index_B, episodes)
    return sums_E, counts_E


def masked_mean_per_episode(
    values_B_T: torch.Tensor, mask_B_T: torch.Tensor, episode_B: torch.Tensor | None = None
) -> torch.Tensor:
    """mean_B: the mean over the active positions of each row's *episode* (all its rows).

    0 for an episode with no active position. With ``episode_B`` None it is
    :func:`masked_mean_per_row`.

    >>> values, mask = torch.tensor([[1.0, 2.0], [6.0, 0.0]]), torch.tensor([[1, 1], [1, 0]])
    >>> masked_mean_per_episode(values, mask, torch.tensor([0, 0]))
    tensor([3., 3.])
    """
    if episode_B is None:
        return masked_mean_per_row(values_B_T, mask_B_T)
    sums_E, counts_E = masked_sum_and_count_per_episode(values_B_T, mask_B_T, episode_B)
    index_B, _ = episode_of_rows(episode_B, values_B_T.shape[0])
    return (sums_E / counts_E.clamp(min=1))[index_B.to(values_B_T.device)]
