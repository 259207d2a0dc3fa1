"""Per-token weights on the policy term: sampler-mismatch correction, off-policy and entropy masks.

These decide how much each token's policy-gradient term counts, before `losses.policy_loss`
normalises. All are pure functions of per-token tensors over completion positions (B sequences,
T positions, V vocab), detached: they weight the gradient, they are not differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.losses import (
    IMPORTANCE_LEVELS,
    log_importance_ratio,
    masked_mean_per_episode,
)

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

    Example:
        >>> old, sampler = torch.tensor([[0.0, 0.0]]), torch.tensor([[-2.0, 0.0]])
        >>> sampler_correction(old, sampler, torch.tensor([[1, 0]]), "token_mask", clip_max=3.0)
        tensor([[0., 0.]])

    """
    granularity, _, constraint = mode.partition("_")
    if granularity not in IMPORTANCE_LEVELS or constraint not in _CONSTRAINTS:
        modes = [f"{g}_{c}" for g in IMPORTANCE_LEVELS for c in _CONSTRAINTS]
        raise ValueError(f"unknown sampler correction mode {mode!r}; expected one of {modes}")
    active_B_T = mask_B_T != 0
    log_ratio_B_T = log_importance_ratio(
        torch.where(active_B_T, old_logprobs_B_T, 0.0),
        torch.where(active_B_T, sampler_logprobs_B_T, 0.0),
        mask_B_T.to(old_logprobs_B_T.dtype),
        granularity,
        episode_B,
    )
    low = 0.0 if clip_min is None else clip_min
    high = float("inf") if clip_max is None else clip_max
    weights_B_T = _CONSTRAINTS[constraint](log_ratio_B_T.exp(), low, high)
    return torch.where(active_B_T, weights_B_T, 0.0)


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

    Example:
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

    Example:
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

    Example:
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


@dataclass(frozen=True)
class TokenWeighting:
    """Which per-token weights multiply the policy term, with their settings.

    Attributes:
        top_entropy_quantile: rho of `top_entropy_mask`; 1.0 keeps every token.
        off_policy_mask_threshold: Threshold of `off_policy_sequence_mask`, or None for none.
        sampler_correction_mode: `sampler_correction`'s mode, or None for no correction.
        clip_max, clip_min: `sampler_correction`'s bounds.
    """

    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    sampler_correction_mode: str | None = None
    clip_max: float | None = None
    clip_min: float | None = None

    @classmethod
    def from_config(cls, args: Any) -> TokenWeighting:
        """The weighting a `GRPOConfig` asks for (the correction only when vLLM samples)."""
        corrects = args.use_vllm and args.vllm_importance_sampling_correction
        return cls(
            args.top_entropy_quantile,
            args.off_policy_mask_threshold,
            args.vllm_importance_sampling_mode if corrects else None,
            args.vllm_importance_sampling_clip_max,
            args.vllm_importance_sampling_clip_min,
        )

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
