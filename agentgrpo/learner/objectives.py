"""The per-token GRPO objectives, as pure functions of per-token tensors.

Steps 1 and 2 of the loss (`losses` is step 3 and the dispatch): an importance ratio
r = pi_theta / pi_old per token (:func:`log_importance_ratio`), token-level or sequence-level
(GSPO); and a per-token objective, returned as a *loss* (the negative objective): the clipped
surrogate (grpo, dr_grpo, dapo, bnpo, luspo), CISPO, SAPO or VESPO; plus the k3 KL to a
reference model (:func:`kl_k3`).

Shapes and masks read as in `losses`: B rows, T completion positions; ``mask_B_T`` is 1 where a
token counts; ``episode_B`` (None: one row per episode) says which episode each row belongs to.
Values at masked positions never reach the loss or its gradient.

The module imports only torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from agentgrpo.learner.masked import (
    episode_of_rows,
    masked_mean_per_episode,
    sum_per_episode,
)

# --------------------------------------------------------------------------- importance ratio


def _token_log_ratio(log_ratio_B_T, mask_B_T, episode_B) -> torch.Tensor:
    return log_ratio_B_T


def _sequence_log_ratio(log_ratio_B_T, mask_B_T, episode_B) -> torch.Tensor:
    mean_B = masked_mean_per_episode(log_ratio_B_T, mask_B_T, episode_B)
    return mean_B.unsqueeze(-1).expand_as(log_ratio_B_T)


_RATIO_LEVELS = {"token": _token_log_ratio, "sequence": _sequence_log_ratio}
IMPORTANCE_LEVELS = tuple(_RATIO_LEVELS)  # "token", "sequence"


def log_importance_ratio(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    level: str = "token",
    episode_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log of the importance ratio pi_theta / pi_old, per token or per sequence (episode).

    Args:
        logprobs_B_T: Log-probabilities of the sampled tokens under the current policy (with
            grad), shape (B, T).
        old_logprobs_B_T: The same under the policy that generated the batch (no grad), (B, T).
        mask_B_T: 1 where the token counts, (B, T).
        level: ``"token"``: ``logprobs - old`` at each active position, 0 at masked ones.
            ``"sequence"`` (GSPO): the masked mean of ``logprobs - old`` over each sequence,
            broadcast to all its positions (padding included; the mask removes them later).
            The gradient flows through the mean, so each token gets 1/|y| of it. The sequence
            is the episode: the mean runs over the active tokens of all its rows.
        episode_B: Each row's episode (see the module docstring); None: one row per episode.

    Returns:
        log_ratio_B_T: Shape (B, T).

    Examples:
        >>> lp, old = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.2, -2.4, 5.0]])
        >>> log_importance_ratio(lp, old, torch.tensor([[1, 1, 0]]), "sequence")
        tensor([[0.3000, 0.3000, 0.3000]])

    """
    if level not in _RATIO_LEVELS:
        raise ValueError(f"unknown importance sampling level {level!r}; expected token or sequence")
    log_ratio_B_T = torch.where(mask_B_T != 0, logprobs_B_T - old_logprobs_B_T, 0.0)
    return _RATIO_LEVELS[level](log_ratio_B_T, mask_B_T, episode_B)


# --------------------------------------------------------------------------- objectives


class PolicyTerm(NamedTuple):
    """A per-token policy loss and where a clip changed it.

    Attributes:
        loss_B_T: Per-token loss (negative objective), (B, T).
        clipped_low_B_T: Bool, where the ratio hit the low bound and that cut the gradient.
        clipped_high_B_T: Bool, where the ratio hit the high bound and that cut the gradient.
        sequence_weight_B_1: A loss's detached per-sequence weight (VESPO's phi), else None.

    """

    loss_B_T: torch.Tensor
    clipped_low_B_T: torch.Tensor
    clipped_high_B_T: torch.Tensor
    sequence_weight_B_1: torch.Tensor | None = None


def clipped_surrogate_loss(
    log_ratio_B_T: torch.Tensor,
    advantages_B_1: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> PolicyTerm:
    """PPO's clipped surrogate, negated: ``-min(r A, clamp(r, 1 - eps_low, 1 + eps_high) A)``.

    Clipping removes the incentive to move r further out of ``[1 - eps_low, 1 + eps_high]``: a
    token with A > 0 and r above the range, or A < 0 and r below it, has zero gradient.
    With ``delta`` (two-sided GRPO, INTELLECT-2) the unclipped term uses ``min(r, delta)``, so a
    token with A < 0 and a huge ratio can no longer give an unbounded loss.

    Args:
        log_ratio_B_T: Log importance ratio, (B, T), token- or sequence-level.
        advantages_B_1: Advantages, broadcastable to (B, T).
        epsilon_low: Lower clip width (ratio floor ``1 - epsilon_low``).
        epsilon_high: Upper clip width (ratio ceiling ``1 + epsilon_high``).
        delta: Cap on r in the unclipped term, or None for standard clipping.

    Returns:
        The per-token loss; ``clipped_low`` is r < 1 - eps_low with A < 0, ``clipped_high`` is
        r > 1 + eps_high with A > 0.

    Examples:
        >>> log_ratio, advantage = torch.tensor([[1.5]]).log(), torch.tensor([[1.0]])
        >>> term = clipped_surrogate_loss(log_ratio, advantage, 0.2, 0.2)
        >>> term.loss_B_T, term.clipped_high_B_T
        (tensor([[-1.2000]]), tensor([[True]]))

    """
    ratio_B_T = log_ratio_B_T.exp()
    unclipped_B_T = ratio_B_T if delta is None else ratio_B_T.clamp(max=delta)
    clipped_B_T = ratio_B_T.clamp(1 - epsilon_low, 1 + epsilon_high)
    loss_B_T = -torch.minimum(unclipped_B_T * advantages_B_1, clipped_B_T * advantages_B_1)
    return PolicyTerm(
        loss_B_T,
        (ratio_B_T < 1 - epsilon_low) & (advantages_B_1 < 0),
        (ratio_B_T > 1 + epsilon_high) & (advantages_B_1 > 0),
    )


def cispo_loss(
    log_ratio_B_T: torch.Tensor,
    advantages_B_1: torch.Tensor,
    logprobs_B_T: torch.Tensor,
    epsilon_max: float,
) -> PolicyTerm:
    """CISPO (MiniMax-M1, ScaleRL): clip the importance *weight*, keep every token's gradient.

    ``loss = -sg(min(r, epsilon_max)) * A * logprobs``: the weight is detached, so the gradient
    is ``-w A grad(logprobs)`` and no token is dropped, however far off-policy.

    Args:
        log_ratio_B_T: Log importance ratio, (B, T).
        advantages_B_1: Advantages, broadcastable to (B, T).
        logprobs_B_T: Current log-probabilities (the gradient flows through these), (B, T).
        epsilon_max: Absolute cap on the weight (not a width around 1), e.g. 5.0.

    Returns:
        The per-token loss; ``clipped_high`` is where the weight was capped with A > 0 (the
        same tokens the clipped surrogate's metric counts); ``clipped_low`` is never set.

    """
    ratio_B_T = log_ratio_B_T.exp()
    weight_B_T = ratio_B_T.clamp(max=epsilon_max).detach()
    return PolicyTerm(
        -weight_B_T * advantages_B_1 * logprobs_B_T,
        torch.zeros_like(ratio_B_T, dtype=torch.bool),
        (ratio_B_T > epsilon_max) & (advantages_B_1 > 0),
    )


def sapo_loss(
    log_ratio_B_T: torch.Tensor,
    advantages_B_1: torch.Tensor,
    temperature_pos: float,
    temperature_neg: float,
) -> PolicyTerm:
    """SAPO: a smooth gate instead of a hard clip, ``loss = -g(r) A``.

    ``g(r) = sigmoid(tau (r - 1)) * 4 / tau``, with ``tau = temperature_pos`` where A > 0 and
    ``temperature_neg`` elsewhere. ``g'(1) = 1``, so on-policy the gradient is the vanilla
    policy gradient; off-policy it fades smoothly (faster for larger tau). Note ``g(1) = 2/tau``:
    the loss *value* is not ``-A`` on-policy, only its gradient matches.

    Args:
        log_ratio_B_T: Log importance ratio, (B, T).
        advantages_B_1: Advantages, broadcastable to (B, T).
        temperature_pos: tau for tokens with positive advantage.
        temperature_neg: tau for tokens with zero or negative advantage.

    Returns:
        The per-token loss; no hard clip, so both clip indicators are all False.

    Examples:
        >>> sapo_loss(torch.zeros(1, 1), torch.tensor([[1.0]]), 1.0, 1.05).loss_B_T
        tensor([[-2.]])

    """
    ratio_B_T = log_ratio_B_T.exp()
    tau_B_T = torch.where(advantages_B_1 > 0, temperature_pos, temperature_neg).to(ratio_B_T)
    gate_B_T = torch.sigmoid(tau_B_T * (ratio_B_T - 1)) * 4 / tau_B_T
    no_clip_B_T = torch.zeros_like(ratio_B_T, dtype=torch.bool)
    return PolicyTerm(-gate_B_T * advantages_B_1, no_clip_B_T, no_clip_B_T)


class VespoShape(NamedTuple):
    """VESPO's Gamma-kernel parameters for one advantage sign (see :func:`vespo_loss`)."""

    k: float
    lam: float


# TRL 1.16's defaults: (vespo_k_pos, vespo_lambda_pos) and (vespo_k_neg, vespo_lambda_neg).
VESPO_POSITIVE = VespoShape(2.0, 3.0)
VESPO_NEGATIVE = VespoShape(3.0, 2.0)

# Sequence log-weights are clamped to [log 1e-8, 20] so that exp() stays finite in float32.
_VESPO_LOG_W_MIN, _VESPO_LOG_W_MAX = math.log(1e-8), 20.0


@torch.no_grad()
def vespo_weights(
    log_ratio_B_T: torch.Tensor,
    advantages_B_1: torch.Tensor,
    mask_B_T: torch.Tensor,
    positive: VespoShape,
    negative: VespoShape,
    episode_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's detached per-sequence weight ``phi(w) = w**k * exp(lam * (1 - w))``.

    ``w = exp(sum_t log r_t)`` is the *sequence* importance weight: the product of the token
    ratios over the active tokens (not GSPO's geometric mean). ``phi`` is a Gamma kernel scaled
    so that ``phi(1) = 1``: on-policy VESPO is the plain policy gradient. It rises as ``w**k``
    for small w, peaks at ``w = k / lam`` and decays as ``exp(-lam w)`` for large w, so stale or
    off-policy sequences fade smoothly instead of being cut by a hard clip. ``k, lam`` are
    ``positive``'s where A >= 0 and ``negative``'s where A < 0. Computed in log space
    (``log phi = lam + k log w - lam w``); a non-finite result becomes 0.

    Args:
        log_ratio_B_T: Log importance ratio per token, (B, T); a sequence-level ratio (its mean
            broadcast) gives the same sum. Each token's value is clamped to [-20, 20].
        advantages_B_1: Advantages, (B, 1).
        mask_B_T: 1 where the token counts, (B, T).
        positive: ``(k, lam)`` for A >= 0.
        negative: ``(k, lam)`` for A < 0.
        episode_B: Each row's episode, (B,); None: one row per episode. The sequence is the
            episode: ``w`` multiplies the ratios of all its rows, and each row gets its weight.

    Returns:
        phi_B_1: Detached weights, (B, 1).

    Examples:
        >>> phi = vespo_weights(torch.zeros(1, 2), torch.ones(1, 1), torch.ones(1, 2),
        ...                     VespoShape(2.0, 3.0), VespoShape(3.0, 2.0))
        >>> phi  # on-policy: w = 1, phi(1) = 1
        tensor([[1.]])

    """
    token_B_T = torch.where(mask_B_T != 0, log_ratio_B_T.clamp(-20.0, 20.0), 0.0)
    index_B, episodes = episode_of_rows(episode_B, token_B_T.shape[0])
    log_w_E = sum_per_episode(token_B_T.sum(dim=-1), index_B, episodes)
    log_w_B_1 = log_w_E[index_B.to(log_w_E.device)].unsqueeze(-1)
    log_w_B_1 = log_w_B_1.clamp(_VESPO_LOG_W_MIN, _VESPO_LOG_W_MAX)
    non_negative_B_1 = advantages_B_1 >= 0
    k_B_1 = torch.where(non_negative_B_1, positive.k, negative.k).to(log_w_B_1)
    lam_B_1 = torch.where(non_negative_B_1, positive.lam, negative.lam).to(log_w_B_1)
    log_phi_B_1 = lam_B_1 + k_B_1 * log_w_B_1 - lam_B_1 * log_w_B_1.exp()
    return log_phi_B_1.exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_loss(
    log_ratio_B_T: torch.Tensor,
    advantages_B_1: torch.Tensor,
    logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    positive: VespoShape = VESPO_POSITIVE,
    negative: VespoShape = VESPO_NEGATIVE,
    episode_B: torch.Tensor | None = None,
) -> PolicyTerm:
    """VESPO (variational sequence-level soft policy optimization): ``-sg(phi(w)) A logprobs``.

    Like CISPO, the weight is detached and multiplies ``A * logprobs``, so the gradient is
    ``-phi(w) A grad(logprobs)`` for every token of the sequence; unlike CISPO the weight is one
    smooth function of the whole sequence's importance weight (:func:`vespo_weights`), with its
    own shape for each advantage sign. TRL 1.16's defaults are ``positive=(2, 3)`` and
    ``negative=(3, 2)``.

    Args:
        log_ratio_B_T: Log importance ratio per token, (B, T).
        advantages_B_1: Advantages, (B, 1).
        logprobs_B_T: Current log-probabilities (the gradient flows through these), (B, T).
        mask_B_T: 1 where the token counts, (B, T).
        positive: ``(k, lam)`` for A >= 0.
        negative: ``(k, lam)`` for A < 0.
        episode_B: Each row's episode, (B,); None: one row per episode.

    Returns:
        The per-token loss; no hard clip, so both clip indicators are all False. Its
        ``sequence_weight_B_1`` is phi.

    Examples:
        >>> term = vespo_loss(torch.zeros(1, 1), torch.tensor([[2.0]]),
        ...                   torch.tensor([[-0.5]]), torch.ones(1, 1))
        >>> term.loss_B_T  # on-policy: phi = 1, loss = -A * logprob
        tensor([[1.]])

    """
    advantages_B_1 = advantages_B_1.expand(log_ratio_B_T.shape[0], 1)
    phi_B_1 = vespo_weights(log_ratio_B_T, advantages_B_1, mask_B_T, positive, negative, episode_B)
    no_clip_B_T = torch.zeros_like(log_ratio_B_T, dtype=torch.bool)
    return PolicyTerm(-phi_B_1 * advantages_B_1 * logprobs_B_T, no_clip_B_T, no_clip_B_T, phi_B_1)


def kl_k3(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): ``exp(d) - d - 1``, ``d = ref - logp``.

    Non-negative, 0 where the two agree, and unbiased for tokens sampled from pi_theta.

    Args:
        logprobs_B_T: Current log-probabilities, (B, T).
        ref_logprobs_B_T: Reference-model log-probabilities of the same tokens, (B, T).

    Returns:
        kl_B_T: Shape (B, T).

    Examples:
        >>> kl_k3(torch.tensor([0.5, 0.25]).log(), torch.tensor([0.5, 0.5]).log())
        tensor([0.0000, 0.3069])

    """
    log_ref_over_policy_B_T = ref_logprobs_B_T - logprobs_B_T
    return log_ref_over_policy_B_T.exp() - log_ref_over_policy_B_T - 1
