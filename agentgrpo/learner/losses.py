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

1. an importance ratio r = pi_theta / pi_old per token (`objectives.log_importance_ratio`),
   token-level or sequence-level (GSPO);
2. a per-token objective, returned as a *loss* (the negative objective): the clipped surrogate
   (grpo, dr_grpo, dapo, bnpo, luspo), CISPO, SAPO or VESPO; plus ``beta`` times the k3 KL to a
   reference model (all in `objectives`);
3. a normalisation that turns per-token losses into one scalar (:func:`aggregate`), here.

``loss_type`` picks the objective and the normalisation together, in one table (``_LOSS_TYPES``)
that is read in one place.

The module imports only torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from agentgrpo.learner.loss_metrics import cispo_metrics, clip_metrics, vespo_metrics
from agentgrpo.learner.masked import (
    episode_of_rows,
    masked_mean,
    masked_sum_and_count_per_episode,
    masked_sum_per_row,
)
from agentgrpo.learner.objectives import (
    IMPORTANCE_LEVELS,
    VESPO_NEGATIVE,
    VESPO_POSITIVE,
    PolicyTerm,
    VespoShape,
    cispo_loss,
    clipped_surrogate_loss,
    kl_k3,
    log_importance_ratio,
    sapo_loss,
    vespo_loss,
)

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
        if self.importance_sampling_level not in IMPORTANCE_LEVELS:
            raise ValueError(
                f"unknown importance_sampling_level {self.importance_sampling_level!r}; "
                f"expected one of {sorted(IMPORTANCE_LEVELS)}"
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
    advantages_B_1 = advantages_B.to(logprobs_B_T.dtype)  # (B,) to (B, 1); per token: (B, T)
    advantages_B_1 = advantages_B_1.unsqueeze(-1) if advantages_B_1.dim() == 1 else advantages_B_1
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
        advantages_B: One advantage per row, (B,): the rows of an episode share its advantage;
            or one per token, (B, T) (credit per turn).
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
