"""Per-token weights on the policy term: sampler-mismatch correction, off-policy and entropy masks.

These decide how much each token's policy-gradient term counts, before `losses.policy_loss`
normalises. All are pure functions of per-token tensors over completion positions (B sequences,
T positions, V vocab), detached: they weight the gradient, they are not differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.masked import masked_mean_per_episode, masked_sum_and_count_per_episode
from agentgrpo.learner.objectives import IMPORTANCE_LEVELS, log_importance_ratio

# --------------------------------------------------------------------------- sampler mismatch


def _truncate(ratio_B_T: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return ratio_B_T.clamp(low, high)


def _zero_outside(ratio_B_T: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.where((ratio_B_T >= low) & (ratio_B_T <= high), ratio_B_T, 0.0)


_CONSTRAINTS = {"truncate": _truncate, "mask": _zero_outside}


@torch.no_grad()
def sampler_correction(
    old_logprobs_B_T: torch.Tensor,
    sampler_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    mode: str,
    clip_max: float | None,
    clip_min: float | None = None,
    episode_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Importance weights for the gap between the generator's and the trainer's logprobs.

    The generator (vLLM, say) samples with slightly different numerics than the trainer, so
    ``exp(old - sampler)`` is not exactly 1. These weights multiply the policy term.

    Args:
        old_logprobs_B_T: The trainer's log-probabilities of the sampled tokens, (B, T).
        sampler_logprobs_B_T: The generator's log-probabilities of the same tokens, (B, T).
        mask_B_T: 1 where the token counts, (B, T).
        mode: ``"<granularity>_<constraint>"``. Granularity ``token``: ratio per token;
            ``sequence``: ``exp`` of the masked mean of ``old - sampler`` over the episode
            (all its rows), broadcast.
            Constraint ``truncate``: clamp to [clip_min, clip_max]; ``mask``: 0 where the ratio
            is outside [clip_min, clip_max] (bounds inclusive).
        clip_max: Upper bound C_max, or None for none.
        clip_min: Lower bound C_min, or None for none.
        episode_B: Each row's episode, (B,); None: one row per episode.

    Returns:
        weights_B_T: Detached, 0 at masked positions.

    Examples:
        >>> old, sampler = torch.tensor([[0.0, 0.0]]), torch.tensor([[-2.0, 0.0]])
        >>> sampler_correction(old, sampler, torch.tensor([[1, 0]]), "token_mask", clip_max=3.0)
        tensor([[0., 0.]])

    """
    granularity, constraint = _correction_mode(mode)
    active_B_T = mask_B_T != 0
    log_ratio_B_T = log_importance_ratio(
        torch.where(active_B_T, old_logprobs_B_T, 0.0),
        torch.where(active_B_T, sampler_logprobs_B_T, 0.0),
        mask_B_T.to(old_logprobs_B_T.dtype),
        granularity,
        episode_B,
    )
    weights_B_T = _constrained(log_ratio_B_T.exp(), constraint, clip_max, clip_min)
    return torch.where(active_B_T, weights_B_T, 0.0)


def _correction_mode(mode: str) -> tuple[str, str]:
    """`"sequence_mask"` -> ("sequence", "mask"); an unknown mode is a ValueError."""
    granularity, _, constraint = mode.partition("_")
    if granularity not in IMPORTANCE_LEVELS or constraint not in _CONSTRAINTS:
        modes = [f"{g}_{c}" for g in IMPORTANCE_LEVELS for c in _CONSTRAINTS]
        raise ValueError(f"unknown sampler correction mode {mode!r}; expected one of {modes}")
    return granularity, constraint


def _constrained(
    ratio: torch.Tensor, constraint: str, clip_max: float | None, clip_min: float | None
) -> torch.Tensor:
    low = 0.0 if clip_min is None else clip_min
    high = float("inf") if clip_max is None else clip_max
    return _CONSTRAINTS[constraint](ratio, low, high)


@torch.no_grad()
def sampler_ratios(
    old_logprobs_B_T: torch.Tensor,
    sampler_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    level: str,
    episode_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """The trainer/sampler ratios ``exp(old - sampler)``, one per unit of `level`, 1-D.

    ``token``: one per active token, in row-major order. ``sequence``: one per episode with an
    active token, ``exp`` of the masked mean of ``old - sampler`` over all its rows, in the
    order of the episode ids (`sampler_correction`'s sequence ratio). These are the values
    `sampler_correction` clips or masks, before it spreads them over the tokens.

    Examples:
        >>> old, sampler = torch.zeros(2, 2), torch.tensor([[0.0, -2.0], [0.0, 5.0]])
        >>> mask = torch.tensor([[1, 1], [0, 0]])
        >>> sampler_ratios(old, sampler, mask, "sequence", torch.tensor([3, 8]))  # e ** 1
        tensor([2.7183])

    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"unknown importance sampling level {level!r}; expected token or sequence")
    active_B_T = mask_B_T != 0
    log_ratio_B_T = old_logprobs_B_T.float() - sampler_logprobs_B_T.float()
    if level == "token":
        return log_ratio_B_T[active_B_T].exp()
    log_ratio_B_T = torch.where(active_B_T, log_ratio_B_T, 0.0)
    sums_E, counts_E = masked_sum_and_count_per_episode(log_ratio_B_T, mask_B_T, episode_B)
    return (sums_E / counts_E.clamp(min=1))[counts_E > 0].exp()


@torch.no_grad()
def off_policy_sequence_mask(
    logprobs_B_T: torch.Tensor,
    sampler_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    threshold: float,
    episode_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which rows to keep under DeepSeek-V3.2's off-policy sequence masking (eq. 9).

    A sequence is dropped when its advantage is negative *and* the policy has drifted from the
    sampler on it: the masked mean of ``sampler - logprobs`` (a per-token KL(sampler || policy)
    estimate) exceeds ``threshold``. Pushing down a sample the policy no longer produces is the
    update that destabilises training; positive samples are always kept.

    Args:
        logprobs_B_T: Current policy log-probabilities, (B, T).
        sampler_logprobs_B_T: The generator's log-probabilities, (B, T).
        advantages_B: One advantage per sequence, (B,).
        mask_B_T: 1 where the token counts, (B, T).
        threshold: The delta of eq. 9, > 0 (e.g. 0.5).
        episode_B: Each row's episode, (B,); None: one row per episode. The sequence is the
            episode: the drift is its mean over all its rows, which are kept or dropped together.

    Returns:
        keep_B: Bool, False for dropped rows. Apply it to the policy term (e.g. multiply
        it into ``sampler_weights_B_T``).

    """
    drift_B = masked_mean_per_episode(sampler_logprobs_B_T - logprobs_B_T, mask_B_T, episode_B)
    return ~((advantages_B < 0) & (drift_B > threshold))


def trl_off_policy_mask(
    advantages: torch.Tensor,
    logprobs_B_T: torch.Tensor,
    sampler_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """`off_policy_sequence_mask` in the form of TRL's `get_off_policy_mask`: keep_B_1.

    One row per sequence, 1.0 keep and 0.0 drop, in `mask_B_T`'s dtype; `advantages` is (B,) or
    (B, 1). Tokens the sampler could not score (NaN) count as no drift.
    """
    logprobs_B_T = logprobs_B_T.detach()
    sampler_B_T = torch.where(sampler_logprobs_B_T.isnan(), logprobs_B_T, sampler_logprobs_B_T)
    keep_B = off_policy_sequence_mask(
        logprobs_B_T, sampler_B_T, advantages.reshape(-1), mask_B_T, threshold
    )
    return keep_B.unsqueeze(1).to(mask_B_T.dtype)


# --------------------------------------------------------------------------- entropy


def entropy_from_logits(logits_B_T_V: torch.Tensor, chunk_size: int = 4) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution at each position.

    Computed ``chunk_size`` sequences at a time in float32, so the float32 copy of the logits
    never exceeds one chunk (the saved activations for backward are not reduced). Logits must be
    finite.

    Args:
        logits_B_T_V: Logits, (B, T, V), any float dtype.
        chunk_size: Sequences per chunk.

    Returns:
        entropy_B_T: float32, (B, T); differentiable.

    Examples:
        >>> entropy_from_logits(torch.zeros(1, 1, 4))
        tensor([[1.3863]])

    """
    entropies = []
    for logits_b_T_V in logits_B_T_V.split(chunk_size):
        logp_b_T_V = logits_b_T_V.float().log_softmax(dim=-1)
        entropies.append(-(logp_b_T_V.exp() * logp_b_T_V).sum(dim=-1))
    return torch.cat(entropies)


def top_entropy_mask(
    entropy_B_T: torch.Tensor, mask_B_T: torch.Tensor, quantile: float
) -> torch.Tensor:
    """Keep only the highest-entropy active tokens ("Beyond the 80/20 Rule").

    ``quantile`` is rho, the fraction kept: a token is kept when it is active and its entropy is
    >= the (1 - rho)-quantile (linear interpolation) of the active tokens' entropies. rho = 1
    keeps every active token; rho = 0 keeps only the highest (ties all kept).

    Args:
        entropy_B_T: Per-token entropies, (B, T).
        mask_B_T: 1 where the token counts, (B, T); only these tokens set the threshold.
        quantile: rho in [0, 1].

    Returns:
        mask_B_T: The narrower mask, in ``mask_B_T``'s dtype.

    Examples:
        >>> top_entropy_mask(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4), 0.5)
        tensor([[0., 0., 1., 1.]])

    """
    if not 0 <= quantile <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    active_B_T = mask_B_T != 0
    if not active_B_T.any():
        return mask_B_T.clone()
    threshold = torch.quantile(entropy_B_T.detach()[active_B_T].float(), 1 - quantile)
    return (active_B_T & (entropy_B_T.detach() >= threshold)).to(mask_B_T.dtype)


def high_entropy_mask(
    entropy_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    threshold: float,
    pool: torch.Tensor | None = None,
) -> torch.Tensor:
    """The active tokens whose entropy reaches the `threshold`-quantile of `pool`.

    TRL's form of `top_entropy_mask`: `threshold` is the quantile to reach (its
    `1 - top_entropy_quantile`), and the quantile is taken over `pool`, the active entropies of
    every process (default: those of `entropy_B_T`).

    Args:
        entropy_B_T: Per-token entropies, (B, T).
        mask_B_T: 1 where the token counts, (B, T).
        threshold: Quantile in [0, 1] (linear interpolation).
        pool: The entropies the quantile is taken over, 1-D.

    Returns:
        Bool (B, T); all False when `pool` is empty.

    Examples:
        >>> high_entropy_mask(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4), 0.5)
        tensor([[False, False,  True,  True]])

    """
    active_B_T = mask_B_T != 0
    if pool is None:
        pool = entropy_B_T.detach()[active_B_T]
    if pool.numel() == 0:
        return torch.zeros_like(active_B_T)
    cut = torch.quantile(pool.float(), threshold)
    return active_B_T & (entropy_B_T.detach() >= cut)


# --------------------------------------------------------------------------- all together


class TokenWeightingFields(Protocol):
    """The `GRPOConfig` fields `TokenWeighting.from_config` reads; the learner imports no config."""

    @property
    def top_entropy_quantile(self) -> float:
        """The rho of `top_entropy_mask`; 1.0 keeps every token."""

    @property
    def off_policy_mask_threshold(self) -> float | None:
        """Threshold of `off_policy_sequence_mask`, or None for none."""

    @property
    def vllm_importance_sampling_mode(self) -> str:
        """The sampler correction's mode (level and constraint, e.g. "sequence_mask")."""

    @property
    def vllm_importance_sampling_clip_max(self) -> float | None:
        """`sampler_correction`'s upper bound."""

    @property
    def vllm_importance_sampling_clip_min(self) -> float | None:
        """`sampler_correction`'s lower bound."""


@dataclass(frozen=True)
class TokenWeighting:
    """Which per-token weights multiply the policy term, with their settings.

    Attributes:
        top_entropy_quantile: rho of `top_entropy_mask`; 1.0 keeps every token.
        off_policy_mask_threshold: Threshold of `off_policy_sequence_mask`, or None for none.
        sampler_correction_mode: `sampler_correction`'s mode, or None for no correction.
        clip_max, clip_min: `sampler_correction`'s bounds.
        sampler_ratio_level: The level ("token" or "sequence") of the trainer/sampler ratio
            logged when there is no correction.
    """

    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    sampler_correction_mode: str | None = None
    clip_max: float | None = None
    clip_min: float | None = None
    sampler_ratio_level: str = "token"

    @classmethod
    def from_config(cls, args: TokenWeightingFields, corrects_sampler: bool) -> TokenWeighting:
        """The weighting a `GRPOConfig` asks for.

        Args:
            args: The config (a `GRPOConfig`).
            corrects_sampler: Whether the sampler correction applies (the trainer asks
                `precision.corrects_sampler_mismatch`: vLLM, or mixed-precision generation).
        """
        mode = args.vllm_importance_sampling_mode
        return cls(
            args.top_entropy_quantile,
            args.off_policy_mask_threshold,
            mode if corrects_sampler else None,
            args.vllm_importance_sampling_clip_max,
            args.vllm_importance_sampling_clip_min,
            _correction_mode(mode)[0],
        )

    def sampler_ratios(self, batch: TrainingBatch, old_B_C: torch.Tensor) -> torch.Tensor:
        """The trainer/sampler ratios to log (see `sampler_ratios`), 1-D.

        With a correction, its weights (clipped or masked, at its level), as TRL logs them;
        without, the raw ratios at `sampler_ratio_level`.
        """
        mode = self.sampler_correction_mode
        level, constraint = _correction_mode(mode) if mode else (self.sampler_ratio_level, "")
        ratios = sampler_ratios(
            old_B_C, batch.sampler_logprobs_B_C, batch.loss_mask_B_C, level, batch.episode_B
        )
        return _constrained(ratios, constraint, self.clip_max, self.clip_min) if mode else ratios

    def weights(
        self,
        batch: TrainingBatch,
        logprobs_B_C: torch.Tensor,
        old_B_C: torch.Tensor,
        entropy_B_C: torch.Tensor,
    ) -> torch.Tensor:
        """weights_B_C: the product of the enabled weights (all ones when none is)."""
        mask_B_C = batch.loss_mask_B_C
        weights_B_C = torch.ones_like(mask_B_C)
        if self.top_entropy_quantile < 1.0:
            weights_B_C = weights_B_C * top_entropy_mask(
                entropy_B_C, mask_B_C, self.top_entropy_quantile
            )
        if self.off_policy_mask_threshold is not None:
            keep_B = off_policy_sequence_mask(
                logprobs_B_C,
                batch.sampler_logprobs_B_C,
                batch.advantages_B,
                mask_B_C,
                self.off_policy_mask_threshold,
                batch.episode_B,
            )
            weights_B_C = weights_B_C * keep_B.unsqueeze(-1)
        if self.sampler_correction_mode is not None:
            weights_B_C = weights_B_C * sampler_correction(
                old_B_C,
                batch.sampler_logprobs_B_C,
                mask_B_C,
                self.sampler_correction_mode,
                self.clip_max,
                self.clip_min,
                batch.episode_B,
            )
        return weights_B_C
