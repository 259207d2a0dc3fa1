"""What the loss logs about its policy term, under the names TRL 1.16 logs it by.

Every loss type logs TRL's five clip metrics of one micro-batch (all 0 for a loss that never
clips, such as sapo and vespo):

- ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean``: the share of active tokens whose
  ratio was clipped low with A < 0, high with A > 0, or either;
- ``clip_ratio/low_min``: the smallest share of a sequence's active tokens clipped low;
- ``clip_ratio/high_max``: the largest share of a sequence's active tokens clipped high.

CISPO adds ``cispo_clip_ratio`` (the share of active tokens whose weight was capped with A > 0)
and VESPO ``vespo/phi_seq_mean`` (the mean sequence weight phi). A sequence is an episode: all
of its rows. Across processes a ``*_min`` metric takes the minimum, a ``*_max`` metric the
maximum and the others the mean (`reduce_over_processes`), as TRL gathers them.

The module imports only torch.
"""

from __future__ import annotations

from typing import Protocol

import torch

from agentgrpo.learner.masked import episode_of_rows, masked_mean, masked_sum_and_count_per_episode


class ClipFlags(Protocol):
    """Where a policy term clipped (`objectives.PolicyTerm` is one)."""

    @property
    def clipped_low_B_T(self) -> torch.Tensor:
        """Bool (B, T): clipped at the low bound with A < 0."""

    @property
    def clipped_high_B_T(self) -> torch.Tensor:
        """Bool (B, T): clipped (or capped) at the high bound with A > 0."""

    @property
    def sequence_weight_B_1(self) -> torch.Tensor | None:
        """A per-sequence weight (VESPO's phi), (B, 1), or None."""


def clip_metrics(
    term: ClipFlags, mask_B_T: torch.Tensor, episode_B: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """TRL's five ``clip_ratio/*`` metrics of one micro-batch, detached scalars.

    ``low_min`` and ``high_max`` are NaN when no episode has an active token.

    Examples:
        >>> from types import SimpleNamespace
        >>> flags = SimpleNamespace(clipped_low_B_T=torch.tensor([[True, False], [False, False]]),
        ...                         clipped_high_B_T=torch.tensor([[False, False], [True, True]]))
        >>> metrics = clip_metrics(flags, torch.ones(2, 2))
        >>> [round(float(metrics[k]), 2) for k in ("clip_ratio/low_min", "clip_ratio/high_max")]
        [0.0, 1.0]

    """
    low_B_T, high_B_T = term.clipped_low_B_T, term.clipped_high_B_T
    mask_B_T = mask_B_T.float()
    return {
        "clip_ratio/low_mean": _share(low_B_T, mask_B_T),
        "clip_ratio/high_mean": _share(high_B_T, mask_B_T),
        "clip_ratio/region_mean": _share(low_B_T | high_B_T, mask_B_T),
        "clip_ratio/low_min": _extreme(_share_per_episode(low_B_T, mask_B_T, episode_B), "min"),
        "clip_ratio/high_max": _extreme(_share_per_episode(high_B_T, mask_B_T, episode_B), "max"),
    }


def cispo_metrics(
    term: ClipFlags, mask_B_T: torch.Tensor, episode_B: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The clip metrics and ``cispo_clip_ratio``: the share of active tokens capped with A > 0."""
    metrics = clip_metrics(term, mask_B_T, episode_B)
    metrics["cispo_clip_ratio"] = metrics["clip_ratio/high_mean"]
    return metrics


def vespo_metrics(
    term: ClipFlags, mask_B_T: torch.Tensor, episode_B: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The clip metrics and ``vespo/phi_seq_mean``: the mean over episodes of their weight phi.

    Raises:
        ValueError: The term carries no sequence weight.
    """
    phi_B_1 = term.sequence_weight_B_1
    if phi_B_1 is None:
        raise ValueError("vespo_metrics needs the term's sequence_weight_B_1")
    index_B, episodes = episode_of_rows(episode_B, phi_B_1.shape[0])
    # The rows of an episode share its weight, so scattering them leaves one value per episode.
    phi_E = phi_B_1.new_zeros(episodes).scatter(0, index_B.to(phi_B_1.device), phi_B_1[:, 0])
    return clip_metrics(term, mask_B_T, episode_B) | {"vespo/phi_seq_mean": phi_E.mean().detach()}


def reduce_over_processes(names: list[str], values_P_M: torch.Tensor) -> list[float]:
    """One value per metric from every process's (a row each): min, max or mean by its name.

    A name ending in ``_min`` takes the minimum, ``_max`` the maximum, any other the mean; NaN
    values are left out (NaN when a metric has no value anywhere).

    Examples:
        >>> values_P_M = torch.tensor([[0.1, 0.5, 2.0], [float("nan"), 0.7, 4.0]])
        >>> reduce_over_processes(["clip_ratio/low_min", "clip_ratio/high_max", "kl"], values_P_M)
        [0.10000000149011612, 0.699999988079071, 3.0]

    """
    return [
        float(_extreme(values_P_M[:, m], name.rpartition("_")[2])) for m, name in enumerate(names)
    ]


def _share(flags_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags_B_T.to(mask_B_T.dtype), mask_B_T).detach()


def _share_per_episode(
    flags_B_T: torch.Tensor, mask_B_T: torch.Tensor, episode_B: torch.Tensor | None
) -> torch.Tensor:
    """share_E: each episode's share of active tokens flagged; NaN for one with none."""
    sums_E, counts_E = masked_sum_and_count_per_episode(
        flags_B_T.to(mask_B_T.dtype), mask_B_T, episode_B
    )
    return torch.where(counts_E > 0, sums_E / counts_E.clamp(min=1), torch.nan).detach()


def _extreme(values_N: torch.Tensor, kind: str) -> torch.Tensor:
    """The min (kind "min"), max ("max") or mean (any other kind) of the non-NaN values.

    NaN when there is none; computed on the device, without a host round trip.
    """
    valid_N = ~values_N.isnan()
    if kind == "min":
        found = torch.where(valid_N, values_N, torch.inf).amin()
    elif kind == "max":
        found = torch.where(valid_N, values_N, -torch.inf).amax()
    else:
        return torch.where(valid_N, values_N, 0.0).sum() / valid_N.sum()  # 0 / 0 is NaN
    return torch.where(valid_N.any(), found, torch.nan)
