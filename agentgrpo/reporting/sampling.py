"""How far the sampler's logprobs are from the trainer's: TRL's `sampling/*` metrics, every step.

TRL logs these five only when vLLM samples with `vllm_importance_sampling_correction`; agentgrpo
logs them every optimizer step for every backend (transformers, vLLM, a `rollout_func`), from
the trainer's logprobs of the sampled tokens under the weights that sampled them (the old
logprobs when the round keeps them, else the loss forward's own, before the optimizer step):

- `sampling/sampling_logp_difference/mean` and `/max`: |trainer - sampler| over the loss-mask
  tokens, NaN (a token the sampler could not score) left out.
- `sampling/importance_sampling_ratio/min`, `/mean` and `/max`: over the ratios
  `TokenWeighting.sampler_ratios` gives: the correction's weights when it is on, else the raw
  `exp(trainer - sampler)`, per token or per episode (`vllm_importance_sampling_mode`'s level).

The statistics cover a whole optimizer step (all its micro-batches, on every process): the mean
is over all of its tokens (TRL: the mean of each process's mean), the max and min over all of
them. A step with no such token logs nothing (TRL logs 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOGP_DIFFERENCE = "sampling/sampling_logp_difference"
IMPORTANCE_RATIO = "sampling/importance_sampling_ratio"
SAMPLING_METRICS = (
    f"{LOGP_DIFFERENCE}/mean",
    f"{LOGP_DIFFERENCE}/max",
    f"{IMPORTANCE_RATIO}/min",
    f"{IMPORTANCE_RATIO}/mean",
    f"{IMPORTANCE_RATIO}/max",
)


def sampling_stats(
    trainer_B_T: torch.Tensor,
    sampler_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    ratios_U: torch.Tensor,
) -> torch.Tensor:
    """stats_8 of one micro-batch, to add up with `combine_stats`.

    Sum, count, min and max of |trainer - sampler| over the mask-1 tokens, then the same four
    of the ratios. NaN values are left out; the min of nothing is +inf, its max -inf. Computed
    on the tensors' device without a host round trip.

    Args:
        trainer_B_T: The trainer's logprobs of the sampled tokens, (B, T).
        sampler_B_T: The sampler's logprobs of the same tokens, (B, T).
        mask_B_T: 1 where the token counts in the loss, (B, T).
        ratios_U: The ratios to log, 1-D (see the module docstring).

    Examples:
        >>> trainer, sampler = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.0, 9.0]])
        >>> sampling_stats(trainer, sampler, torch.tensor([[1, 1, 0]]), torch.tensor([1.0, 0.5]))
        tensor([1.5000, 2.0000, 0.5000, 1.0000, 1.5000, 2.0000, 0.5000, 1.0000])

    """
    difference_B_T = (trainer_B_T.float() - sampler_B_T.float()).abs()
    ratios_U = ratios_U.float()
    return torch.cat(
        [
            _sum_count_min_max(difference_B_T, (mask_B_T != 0) & ~difference_B_T.isnan()),
            _sum_count_min_max(ratios_U, ~ratios_U.isnan()),
        ]
    )


def _sum_count_min_max(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(sum, count, min, max) of `values` where `valid`; min +inf and max -inf where none is."""
    values, valid = values.flatten(), valid.flatten()
    inf_1 = values.new_tensor([torch.inf])
    return torch.stack(
        [
            torch.where(valid, values, 0.0).sum(),
            valid.sum().to(values.dtype),
            torch.cat([torch.where(valid, values, torch.inf), inf_1]).min(),
            torch.cat([torch.where(valid, values, -torch.inf), -inf_1]).max(),
        ]
    )


def combine_stats(first_8: torch.Tensor, second_8: torch.Tensor) -> torch.Tensor:
    """The `sampling_stats` of two sets of tokens taken together."""
    first_2_4, second_2_4 = first_8.reshape(2, 4), second_8.reshape(2, 4)
    sums_2_2 = first_2_4[:, :2] + second_2_4[:, :2]
    mins_2_1 = torch.minimum(first_2_4[:, 2:3], second_2_4[:, 2:3])
    maxes_2_1 = torch.maximum(first_2_4[:, 3:], second_2_4[:, 3:])
    return torch.cat([sums_2_2, mins_2_1, maxes_2_1], dim=1).reshape(8)


def sampling_metrics(stats_P_8: torch.Tensor) -> dict[str, float]:
    """The five metrics from every process's `sampling_stats` (one row each).

    A metric with no value to summarise is left out.

    Examples:
        >>> stats_P_8 = torch.tensor([[1.5, 2, 0.5, 1, 1.5, 2, 0.5, 1], [3, 1, 3, 3, 4, 1, 4, 4]])
        >>> for name, value in sampling_metrics(stats_P_8).items():
        ...     print(f"{name} {value:.4f}")
        sampling/sampling_logp_difference/mean 1.5000
        sampling/sampling_logp_difference/max 3.0000
        sampling/importance_sampling_ratio/min 0.5000
        sampling/importance_sampling_ratio/mean 1.8333
        sampling/importance_sampling_ratio/max 4.0000

    """
    total_8 = stats_P_8[0]
    for row_8 in stats_P_8[1:]:
        total_8 = combine_stats(total_8, row_8)
    (difference_sum, tokens, _, difference_max), (ratio_sum, ratios, ratio_min, ratio_max) = (
        total_8.double().reshape(2, 4).tolist()
    )
    metrics: dict[str, float] = {}
    if tokens > 0:
        metrics[SAMPLING_METRICS[0]] = difference_sum / tokens
        metrics[SAMPLING_METRICS[1]] = difference_max
    if ratios > 0:
        metrics[SAMPLING_METRICS[2]] = ratio_min
        metrics[SAMPLING_METRICS[3]] = ratio_sum / ratios
        metrics[SAMPLING_METRICS[4]] = ratio_max
    return metrics


class SamplingWindow:
    """The `sampling_stats` of the micro-batches since the window last closed.

    `add` after each loss forward; `close` at each optimizer step (and after each evaluation
    batch) gathers every process's window, returns the metrics and starts a new window. The
    sums stay on the device until `close`: no host round trip per micro-batch.
    """

    def __init__(self) -> None:
        self._stats_8: torch.Tensor | None = None

    def add(
        self,
        trainer_B_T: torch.Tensor,
        sampler_B_T: torch.Tensor,
        mask_B_T: torch.Tensor,
        ratios_U: torch.Tensor,
    ) -> None:
        """Add one micro-batch's tokens (see `sampling_stats`)."""
        stats_8 = sampling_stats(trainer_B_T.detach(), sampler_B_T, mask_B_T, ratios_U)
        self._stats_8 = stats_8 if self._stats_8 is None else combine_stats(self._stats_8, stats_8)

    def close(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Every process's window (`gather`: rows of all processes, in order), as metrics.

        Every process must call it at the same point, as with any gather. A process that saw no
        micro-batch since the last close contributes an empty window.
        """
        local_8 = self._stats_8 if self._stats_8 is not None else _EMPTY_STATS
        self._stats_8 = None
        return sampling_metrics(gather(local_8.unsqueeze(0)))


# The stats of no token at all.
_EMPTY_STATS = torch.tensor([0.0, 0.0, torch.inf, -torch.inf] * 2)
