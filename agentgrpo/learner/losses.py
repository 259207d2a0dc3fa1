"""The GRPO policy loss and its variants, as pure functions of per-token tensors.

Every tensor is over completion positions of a padded batch: B rows, T positions, V vocab.
An episode is usually one row; a forked episode (`rollout.Episode.rows`) is several, all with its
one advantage. ``episode_B`` (optional everywhere; None means one row per episode) says which
episode each row belongs to, and every per-sequence quantity is per *episode*: the sequence-level
ratio, the per-sequence mean, and the sequence count that dr_grpo divides by.
``mask_B_T`` (bool or 0/1 float) is 1 where a token counts in the loss: the policy sampled it and
nothing else masked it out. Tool output, template tokens and padding are 0. Values at masked
positions never reach the loss or its gradient, whatever they are (even inf or NaN).

The loss is built in three steps, each its own function:

1. an importance ratio r = pi_theta / pi_old per token (:func:`log_importance_ratio`), token-level
   or sequence-level (GSPO);
2. a per-token objective, returned as a *loss* (the negative objective): the clipped surrogate
   (grpo, dr_grpo, dapo, bnpo, luspo), CISPO, SAPO or VESPO; plus ``beta`` times the k3 KL to a
   reference model;
3. a normalisation that turns per-token losses into one scalar (:func:`aggregate`).

``loss_type`` picks the objective and the normalisation together, in one table (``_LOSS_TYPES``)
that is read in one place.

The module imports only torch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from agentgrpo.learner.loss_metrics import cispo_metrics, clip_metrics, vespo_metrics
from agentgrpo.learner.masked import (
    episode_of_rows,
    masked_mean,
    masked_mean_per_episode,
    masked_sum_and_count_per_episode,
    masked_sum_per_row,
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


# --------------------------------------------------------------------------- normalisation
# Each normaliser turns per-token losses (B, T), a float mask (B, T) and each row's episode
# (episode_B, or None: one row per episode) into the scalar loss. num_items and
# max_completion_length are passed to all of them; each uses what it needs. An episode's rows
# are one sequence: every token counts once, and sequences are counted as episodes.


Normaliser = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        "torch.Tensor | None",
        "float | torch.Tensor | None",
        "int | None",
    ],
    torch.Tensor,
]


def _per_sequence_mean(loss_B_T, mask_B_T, episode_B, num_items, max_completion_length):
    """grpo: mean over episodes of each one's token mean over all its rows (see GRPOConfig).

    A length bias, as in the paper; an episode with no active token counts as 0.
    """
    sums_E, counts_E = masked_sum_and_count_per_episode(loss_B_T, mask_B_T, episode_B)
    return (sums_E / counts_E.clamp(min=1)).mean()


def _local_token_mean(loss_B_T, mask_B_T, episode_B, num_items, max_completion_length):
    """bnpo: mean over the active tokens of this micro-batch only (rows do not matter)."""
    return masked_mean(loss_B_T, mask_B_T)


def _over_max_length(loss_B_T, mask_B_T, episode_B, num_items, max_completion_length):
    """dr_grpo: token sum over a constant, E * max_completion_length (E episodes, not rows)."""
    if max_completion_length is None:
        raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
    total = masked_sum_per_row(loss_B_T, mask_B_T).sum()
    _, episodes = episode_of_rows(episode_B, loss_B_T.shape[0])
    return total / (episodes * max_completion_length)


def _over_num_items(loss_B_T, mask_B_T, episode_B, num_items, max_completion_length):
    """dapo, cispo, sapo, vespo: token sum over the active tokens of the whole accumulated batch.

    Rows do not matter: each token counts once.
    """
    if num_items is None:
        raise ValueError("this loss_type needs num_items (active tokens in the whole batch)")
    return masked_sum_per_row(loss_B_T, mask_B_T).sum() / num_items


def _length_scaled_over_num_items(loss_B_T, mask_B_T, episode_B, num_items, max_completion_length):
    """luspo: each episode's loss times its token count (all its rows), summed, over num_items.

    An episode's loss is its mean per-token loss (GSPO; with a sequence-level ratio every token
    holds the same value). Scaling it by the length |y_i| undoes GSPO's 1/|y_i| weight on each
    token's gradient; dividing by num_items then gives every token dapo's gradient scale. (The
    product equals the masked token sum; it is written out because it is the definition.)
    """
    if num_items is None:
        raise ValueError("loss_type 'luspo' needs num_items (active tokens in the whole batch)")
    sums_E, counts_E = masked_sum_and_count_per_episode(loss_B_T, mask_B_T, episode_B)
    return (sums_E / counts_E.clamp(min=1) * counts_E).sum() / num_items


# --------------------------------------------------------------------------- the loss types


@dataclass(frozen=True)
class LossConfig:
    """What the policy loss needs from the training config; checked once, on construction.

    Attributes:
        loss_type: One of grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo: picks the per-token
            objective and the normalisation together (see :func:`aggregate`).
        epsilon_low: Clip width below 1 for the clipped surrogate (ratio floor 1 - epsilon_low).
        epsilon_high: Clip width above 1 for the clipped surrogate (ratio ceiling
            1 + epsilon_high; DAPO uses 0.28). For cispo it is the absolute weight cap
            epsilon_max instead (ScaleRL uses 5.0); TRL's default there is epsilon (0.2),
            accepted with a warning, since a cap below 1 scales down even on-policy tokens.
        delta: Two-sided GRPO (INTELLECT-2): cap on the ratio in the unclipped term, > 1
            (advised > 1 + epsilon_high). None for standard clipping. Clipped-surrogate types only.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO, which luspo is meant
            for: with token ratios luspo is dapo's token sum, as in TRL, which warns).
        beta: Weight of the k3 KL to the reference model; 0 turns it off.
        use_bias_correction_kl: Multiply the per-token KL by the (differentiable) importance
            ratio, which makes its gradient the unbiased reverse-KL gradient (DeepSeek-V3.2).
            Changes the gradient even on-policy, where the ratio's value is 1.
        sapo_temperature_pos: SAPO's tau for tokens with positive advantage.
        sapo_temperature_neg: SAPO's tau for the other tokens.
        vespo_positive: VESPO's ``(k, lam)`` for A >= 0 (see :func:`vespo_weights`).
        vespo_negative: VESPO's ``(k, lam)`` for A < 0.
        max_completion_length: The constant dr_grpo divides by (per sequence); required there.
        entropy_coef: Weight of the entropy bonus: the loss gets ``- entropy_coef * mean
            entropy`` over active tokens, the same for every loss_type.

    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_positive: VespoShape = VESPO_POSITIVE
    vespo_negative: VespoShape = VESPO_NEGATIVE
    max_completion_length: int | None = None
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_type not in _LOSS_TYPES:
            raise ValueError(
                f"unknown loss_type {self.loss_type!r}; expected one of {sorted(_LOSS_TYPES)}"
            )
        if self.importance_sampling_level not in _RATIO_LEVELS:
            raise ValueError(
                f"unknown importance_sampling_level {self.importance_sampling_level!r}; "
                f"expected one of {sorted(_RATIO_LEVELS)}"
            )
        if not 0 <= self.epsilon_low <= 1 or self.epsilon_high < 0:
            raise ValueError(
                f"need 0 <= epsilon_low <= 1 and epsilon_high >= 0, "
                f"got {self.epsilon_low} and {self.epsilon_high}"
            )
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        _LOSS_TYPES[self.loss_type].check(self)


def _check_clipped(config: LossConfig) -> None:
    if config.delta is not None and config.delta <= 1:
        raise ValueError(f"delta caps the ratio and must be > 1, got {config.delta}")


def _check_dr_grpo(config: LossConfig) -> None:
    _check_clipped(config)
    if config.max_completion_length is None or config.max_completion_length < 1:
        raise ValueError("loss_type 'dr_grpo' needs max_completion_length >= 1")


def _check_no_delta(config: LossConfig) -> None:
    if config.delta is not None:
        raise ValueError(
            f"delta applies to the clipped surrogate; loss_type {config.loss_type!r} has none"
        )


def _check_cispo(config: LossConfig) -> None:
    _check_no_delta(config)
    if config.epsilon_high <= 0:
        raise ValueError(
            "for loss_type 'cispo', epsilon_high is the absolute cap on the importance weight "
            f"(e.g. 5.0) and must be > 0, got {config.epsilon_high}"
        )
    if config.epsilon_high <= 1:
        # TRL's default (epsilon_high = epsilon = 0.2) lands here; TRL trains with it.
        warnings.warn(
            f"loss_type 'cispo' caps the importance weight at epsilon_high={config.epsilon_high}"
            ", below 1, so every token's gradient is scaled down to at most that; ScaleRL "
            "uses epsilon_high=5.0",
            stacklevel=4,
        )


def _check_sapo(config: LossConfig) -> None:
    _check_no_delta(config)
    if config.sapo_temperature_pos <= 0 or config.sapo_temperature_neg <= 0:
        raise ValueError("SAPO temperatures must be > 0")


def _check_vespo(config: LossConfig) -> None:
    _check_no_delta(config)
    for sign, shape in (("pos", config.vespo_positive), ("neg", config.vespo_negative)):
        if shape.k < 0 or shape.lam <= 0:
            raise ValueError(
                f"VESPO needs vespo_k_{sign} >= 0 and vespo_lambda_{sign} > 0 (the Gamma kernel "
                f"w**k * exp(lambda * (1 - w))), got k={shape.k} and lambda={shape.lam}"
            )


def _clipped(
    log_ratio_B_T, advantages_B_1, logprobs_B_T, mask_B_T, episode_B, config
) -> PolicyTerm:
    return clipped_surrogate_loss(
        log_ratio_B_T, advantages_B_1, config.epsilon_low, config.epsilon_high, config.delta
    )


def _cispo(log_ratio_B_T, advantages_B_1, logprobs_B_T, mask_B_T, episode_B, config) -> PolicyTerm:
    return cispo_loss(log_ratio_B_T, advantages_B_1, logprobs_B_T, config.epsilon_high)


def _sapo(log_ratio_B_T, advantages_B_1, logprobs_B_T, mask_B_T, episode_B, config) -> PolicyTerm:
    return sapo_loss(
        log_ratio_B_T, advantages_B_1, config.sapo_temperature_pos, config.sapo_temperature_neg
    )


def _vespo(log_ratio_B_T, advantages_B_1, logprobs_B_T, mask_B_T, episode_B, config) -> PolicyTerm:
    return vespo_loss(
        log_ratio_B_T,
        advantages_B_1,
        logprobs_B_T,
        mask_B_T,
        config.vespo_positive,
        config.vespo_negative,
        episode_B,
    )


class _LossType(NamedTuple):
    # (log_ratio_B_T, advantages_B_1, logprobs_B_T, mask_B_T, episode_B, config) -> PolicyTerm
    objective: Callable[..., PolicyTerm]
    normalise: Normaliser
    check: Callable[[LossConfig], None]
    # (term, mask_B_T, episode_B) -> what the term logs, under TRL's names (`loss_metrics`)
    metrics: Callable[..., dict[str, torch.Tensor]] = clip_metrics


# The one place a loss_type string becomes behaviour.
_LOSS_TYPES: dict[str, _LossType] = {
    "grpo": _LossType(_clipped, _per_sequence_mean, _check_clipped),
    "bnpo": _LossType(_clipped, _local_token_mean, _check_clipped),
    "dr_grpo": _LossType(_clipped, _over_max_length, _check_dr_grpo),
    "dapo": _LossType(_clipped, _over_num_items, _check_clipped),
    "cispo": _LossType(_cispo, _over_num_items, _check_cispo, cispo_metrics),
    "sapo": _LossType(_sapo, _over_num_items, _check_sapo),
    "luspo": _LossType(_clipped, _length_scaled_over_num_items, _check_clipped),
    "vespo": _LossType(_vespo, _over_num_items, _check_vespo, vespo_metrics),
}


def normalises_by_num_items(loss_type: str) -> bool:
    """Whether a loss type divides by `num_items`, the active tokens of the global batch.

    Such a loss is a share of the whole optimizer step's loss; the others are means over one
    micro-batch. The trainer scales the two kinds differently under accumulation and DDP.
    """
    return _LOSS_TYPES[loss_type].normalise in (_over_num_items, _length_scaled_over_num_items)


def aggregate(
    per_token_loss_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    loss_type: str,
    *,
    num_items: float | torch.Tensor | None = None,
    max_completion_length: int | None = None,
    episode_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to the scalar loss, normalised as ``loss_type`` defines.

    A sequence is an episode: all the rows ``episode_B`` gives the same value (one row each
    when it is None). E is the number of episodes among the rows.

    ``"grpo"``: mean over the E episodes of (masked sum / masked count) over all the episode's
    rows, count clamped to >= 1.
    ``"bnpo"``: masked sum / masked count of this micro-batch (clamped to >= 1); rows do not
    matter.
    ``"dr_grpo"``: masked sum / (E * max_completion_length): episodes are counted, not rows.
    ``"dapo"``, ``"cispo"``, ``"sapo"``, ``"vespo"``: masked sum / num_items; rows do not matter.
    ``"luspo"``: sum over episodes of (episode mean * episode token count) / num_items.

    Args:
        per_token_loss_B_T: Per-token loss, (B, T).
        mask_B_T: 1 where the token counts, (B, T); values elsewhere are ignored, NaN included.
        loss_type: See above.
        num_items: Active (mask-1) tokens in the *whole* batch of this optimizer step: every
            gradient-accumulation micro-batch on every process. Summing this function's result
            over one process's micro-batches then gives that process's share of the global token
            mean; undoing the data-parallel gradient average (multiplying by the number of
            processes) is the trainer's job. Needed by dapo, cispo, sapo, luspo.
        max_completion_length: Needed by dr_grpo.
        episode_B: Each row's episode (any ids; rows with equal ids are one episode), (B,).
            Rows of one episode must be in the same call (micro-batch) for grpo and dr_grpo.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: On an unknown loss_type or a missing argument it needs.

    Examples:
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> aggregate(loss, mask, "grpo"), aggregate(loss, mask, "dapo", num_items=10)
        (tensor(2.7500), tensor(0.7000))

    """
    if loss_type not in _LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {sorted(_LOSS_TYPES)}")
    mask_B_T = mask_B_T.to(per_token_loss_B_T.dtype)
    return _LOSS_TYPES[loss_type].normalise(
        per_token_loss_B_T, mask_B_T, episode_B, num_items, max_completion_length
    )


# --------------------------------------------------------------------------- the policy loss


@dataclass(frozen=True)
class LossOutput:
    """The scalar loss and what to log about it.

    Attributes:
        loss: Scalar tensor to call ``backward()`` on.
        metrics: Detached scalars over this call's active tokens: the loss type's
            ``clip_ratio/*`` and own metrics (see `loss_metrics`); ``kl`` (mean of the
            per-token KL term, bias-corrected if configured) when a reference is given;
            ``entropy`` (mean entropy) when entropies are given; ``policy_loss``: the loss
            before the entropy bonus.

    The entropy bonus and the grpo, bnpo and dr_grpo normalisers are means over this
    micro-batch; the dapo, cispo, sapo and luspo losses are shares of the global batch (they
    divide by num_items), so the trainer scales the two kinds differently under accumulation.

    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _per_token_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    config: LossConfig,
    ref_logprobs_B_T: torch.Tensor | None,
    sampler_weights_B_T: torch.Tensor | None,
    episode_B: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``objective(r, A) * sampler_weights + beta * kl`` per token, with its metrics."""
    active_B_T = mask_B_T != 0

    def zero_padding(values_B_T: torch.Tensor) -> torch.Tensor:
        # Padding garbage (inf, NaN) must reach neither the loss nor the gradient, e.g. through a
        # sequence-level mean; torch.where gives exactly 0 gradient to what it does not select.
        return torch.where(active_B_T, values_B_T, 0.0)

    logprobs_B_T = zero_padding(logprobs_B_T)
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    log_ratio_B_T = log_importance_ratio(
        logprobs_B_T,
        zero_padding(old_logprobs_B_T),
        mask_B_T,
        config.importance_sampling_level,
        episode_B,
    )
    advantages_B_1 = advantages_B.to(logprobs_B_T.dtype).unsqueeze(-1)
    objective = _LOSS_TYPES[config.loss_type].objective
    term = objective(log_ratio_B_T, advantages_B_1, logprobs_B_T, mask_B_T, episode_B, config)
    metrics = _LOSS_TYPES[config.loss_type].metrics(term, mask_B_T, episode_B)
    per_token_B_T = term.loss_B_T
    if sampler_weights_B_T is not None:
        per_token_B_T = per_token_B_T * zero_padding(sampler_weights_B_T.detach())
    if ref_logprobs_B_T is not None:
        kl_B_T = kl_k3(logprobs_B_T, zero_padding(ref_logprobs_B_T))
        if config.use_bias_correction_kl:
            kl_B_T = kl_B_T * log_ratio_B_T.exp()
        per_token_B_T = per_token_B_T + config.beta * kl_B_T
        metrics["kl"] = masked_mean(kl_B_T, mask_B_T).detach()
    return per_token_B_T, metrics


def policy_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    config: LossConfig,
    *,
    ref_logprobs_B_T: torch.Tensor | None = None,
    sampler_weights_B_T: torch.Tensor | None = None,
    num_items: float | torch.Tensor | None = None,
    entropy_B_T: torch.Tensor | None = None,
    entropy_coef: float | None = None,
    episode_B: torch.Tensor | None = None,
) -> LossOutput:
    """The GRPO loss of one micro-batch: policy term, KL penalty, normalisation, entropy bonus.

    ``per_token = objective(r, A) * sampler_weights + beta * kl``, reduced by :func:`aggregate`
    for ``config.loss_type``, minus ``entropy_coef`` times the mean active-token entropy.

    Args:
        logprobs_B_T: Current log-probabilities of the completion tokens (with grad), (B, T).
        old_logprobs_B_T: Under the policy that sampled the batch; ``logprobs_B_T.detach()`` on
            the first pass over it.
        advantages_B: One advantage per row, (B,): the rows of an episode share its advantage.
        mask_B_T: 1 where the token counts. Masked positions get exactly zero gradient and no
            say in the loss, whatever any input holds there (inf and NaN included).
        config: The checked loss settings.
        ref_logprobs_B_T: Reference-model log-probabilities; required when beta > 0.
        sampler_weights_B_T: Weights on the *policy term only* (not the KL; detached here):
            :func:`sampler_correction`'s, times any policy-only mask the trainer folds in
            (``off_policy_sequence_mask``, :func:`top_entropy_mask`), so that the KL and the
            normalisers still count every completion token.
        num_items: Active tokens of the whole accumulated batch; see :func:`aggregate`.
        entropy_B_T: Per-token entropies; with grad when ``entropy_coef != 0``.
        entropy_coef: Overrides ``config.entropy_coef`` for this call (adaptive entropy
            control changes it between optimizer steps); None keeps the config's.
        episode_B: Each row's episode, (B,); None: one row per episode. The sequence-level
            ratio and the per-sequence normalisers run over an episode's rows together.

    Returns:
        The loss (see :class:`LossOutput` for which parts are micro-batch means) and metrics.

    """
    if config.beta > 0 and ref_logprobs_B_T is None:
        raise ValueError(f"beta={config.beta} > 0 needs ref_logprobs_B_T")
    coef = config.entropy_coef if entropy_coef is None else entropy_coef
    if coef != 0 and entropy_B_T is None:
        raise ValueError(f"entropy_coef={coef} needs entropy_B_T")
    per_token_B_T, metrics = _per_token_loss(
        logprobs_B_T,
        old_logprobs_B_T,
        advantages_B,
        mask_B_T,
        config,
        ref_logprobs_B_T,
        sampler_weights_B_T,
        episode_B,
    )
    loss = aggregate(
        per_token_B_T,
        mask_B_T,
        config.loss_type,
        num_items=num_items,
        max_completion_length=config.max_completion_length,
        episode_B=episode_B,
    )
    metrics["policy_loss"] = loss.detach()
    mask_B_T = mask_B_T.to(per_token_B_T.dtype)
    if entropy_B_T is not None:
        mean_entropy = masked_mean(torch.where(mask_B_T != 0, entropy_B_T, 0.0), mask_B_T)
        metrics["entropy"] = mean_entropy.detach()
        loss = loss - coef * mean_entropy if coef else loss
    return LossOutput(loss, metrics)
