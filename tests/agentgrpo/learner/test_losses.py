"""The policy loss and its parts, against numbers worked out by hand (in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from agentgrpo.learner.losses import LossConfig, aggregate, policy_loss
from agentgrpo.learner.objectives import (
    cispo_loss,
    clipped_surrogate_loss,
    kl_k3,
    log_importance_ratio,
    sapo_loss,
)
from agentgrpo.learner.token_weights import (
    entropy_from_logits,
    off_policy_sequence_mask,
    sampler_correction,
    top_entropy_mask,
)

LN2 = math.log(2)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype))


# --------------------------------------------------------------------------- normalisation

# Per-token losses [[1, 2, 3], [4, 5, 6]]; the first row has 2 active tokens, the second 1.
LOSS_2x3 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_2x3 = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_grpo_averages_each_sequences_token_mean():
    # Row means (1 + 2) / 2 = 1.5 and 4 / 1 = 4; their mean is 2.75.
    close(aggregate(LOSS_2x3, MASK_2x3, "grpo"), 2.75)


def test_bnpo_divides_by_the_local_active_token_count():
    # (1 + 2 + 4) / 3 tokens.
    close(aggregate(LOSS_2x3, MASK_2x3, "bnpo"), 7 / 3)


def test_dr_grpo_divides_by_batch_size_times_max_completion_length():
    # 7 / (2 sequences * 4).
    close(aggregate(LOSS_2x3, MASK_2x3, "dr_grpo", max_completion_length=4), 0.875)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "sapo"])
def test_global_token_losses_divide_by_num_items(loss_type):
    # 7 / 10 active tokens in the whole accumulated batch.
    close(aggregate(LOSS_2x3, MASK_2x3, loss_type, num_items=10), 0.7)


def test_luspo_scales_each_sequence_loss_by_its_length():
    # Sequence losses (row means) 1.5 and 4, lengths 2 and 1: (3 + 4) / 10.
    close(aggregate(LOSS_2x3, MASK_2x3, "luspo", num_items=10), 0.7)


def test_an_empty_sequence_contributes_nothing_and_divides_by_one():
    # grpo: row means 1.5 and 0 (no tokens, count clamped to 1): mean 0.75.
    close(aggregate(LOSS_2x3, torch.tensor([[1, 1, 0], [0, 0, 0]]), "grpo"), 0.75)


def test_normalisers_that_need_an_argument_say_so():
    with pytest.raises(ValueError, match="num_items"):
        aggregate(LOSS_2x3, MASK_2x3, "dapo")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate(LOSS_2x3, MASK_2x3, "dr_grpo")
    with pytest.raises(ValueError, match="expected one of"):
        aggregate(LOSS_2x3, MASK_2x3, "ppo")


# --------------------------------------------------------------------------- clipped surrogate

# Four tokens, eps_low 0.2 and eps_high 0.28: the ratio range is [0.8, 1.28].
RATIOS = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, -1.0]])


def test_clipped_surrogate_clips_each_side_only_where_it_limits_the_update():
    log_ratio = RATIOS.log().requires_grad_()
    term = clipped_surrogate_loss(log_ratio, ADVANTAGES, 0.2, 0.28)
    # A=+1, r=1.5: min(1.5, 1.28) = 1.28 -> loss -1.28, clipped high.
    # A=+1, r=0.5: min(0.5, 0.8) = 0.5 -> loss -0.5, not clipped (moving up is allowed).
    # A=-1, r=0.5: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped low.
    # A=-1, r=1.5: min(-1.5, -1.28) = -1.5 -> loss 1.5, not clipped.
    close(term.loss_B_T, [[-1.28, -0.5, 0.8, 1.5]])
    assert term.clipped_high_B_T.tolist() == [[True, False, False, False]]
    assert term.clipped_low_B_T.tolist() == [[False, False, True, False]]
    # d(-r A)/d(log r) = -r A where unclipped, 0 where clipped.
    term.loss_B_T.sum().backward()
    close(log_ratio.grad, [[0.0, -0.5, 0.0, 1.5]])


def test_two_sided_clipping_caps_the_ratio_of_negative_advantage_tokens_at_delta():
    log_ratio = torch.tensor([[3.0]]).log().requires_grad_()
    advantage = torch.tensor([[-1.0]])
    # Standard: min(3 * -1, 1.28 * -1) = -3 -> loss 3.
    close(clipped_surrogate_loss(log_ratio, advantage, 0.2, 0.28).loss_B_T, [[3.0]])
    # delta=2: min(min(3, 2) * -1, -1.28) = -2 -> loss 2, and no gradient (r is past delta).
    term = clipped_surrogate_loss(log_ratio, advantage, 0.2, 0.28, delta=2.0)
    close(term.loss_B_T, [[2.0]])
    term.loss_B_T.sum().backward()
    close(log_ratio.grad, [[0.0]])


def test_sequence_level_ratio_is_the_masked_mean_log_ratio_broadcast():
    logprobs = torch.tensor([[-1.0, -2.0, 7.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -2.4, -9.0]])
    # Active differences 0.2 and 0.4: mean 0.3 on every position; the padded 7 - (-9) is ignored.
    log_ratio = log_importance_ratio(logprobs, old, torch.tensor([[1, 1, 0]]), "sequence")
    close(log_ratio, [[0.3, 0.3, 0.3]])
    # The gradient flows through the mean: 1/2 to each active token, 0 to padding.
    log_ratio[0, 0].backward()
    close(logprobs.grad, [[0.5, 0.5, 0.0]])


def test_token_level_ratio_is_zero_at_masked_positions():
    log_ratio = log_importance_ratio(
        torch.tensor([[-1.0, 5.0]]), torch.tensor([[-1.5, 0.0]]), torch.tensor([[1, 0]])
    )
    close(log_ratio, [[0.5, 0.0]])


# --------------------------------------------------------------------------- cispo and sapo


def test_cispo_gradient_is_minus_capped_detached_weight_times_advantage():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - LN2, -2.0 - math.log(8)]])
    # r = 2 and 8; weights capped at 5: w = [2, 5]. A = 1.5.
    term = cispo_loss(logprobs - old, torch.tensor([[1.5]]), logprobs, epsilon_max=5.0)
    # loss = -w A logp = [-2 * 1.5 * -1, -5 * 1.5 * -2] = [3, 15].
    close(term.loss_B_T, [[3.0, 15.0]])
    # The weight is detached, so d/dlogp = -w A = [-3, -7.5] (not -w A (1 + logp)).
    term.loss_B_T.sum().backward()
    close(logprobs.grad, [[-3.0, -7.5]])
    assert term.clipped_high_B_T.tolist() == [[False, True]]


def test_sapo_gate_uses_the_temperature_of_the_advantage_sign():
    # g(r) = sigmoid(tau (r - 1)) * 4 / tau.
    # r=1, A=+1, tau_pos=1: g = 0.5 * 4 = 2 -> loss -2.
    # r=1, A=-1, tau_neg=2: g = 0.5 * 4 / 2 = 1 -> loss +1.
    # r=2, A=+1, tau_pos=1: g = sigmoid(1) * 4 = 0.7310586 * 4 = 2.9242344 -> loss -2.9242344.
    log_ratio = torch.tensor([[1.0, 1.0, 2.0]]).log()
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    term = sapo_loss(log_ratio, advantages, temperature_pos=1.0, temperature_neg=2.0)
    close(term.loss_B_T, [[-2.0, 1.0, -2.9242344]])
    assert not term.clipped_low_B_T.any() and not term.clipped_high_B_T.any()


def test_sapo_on_policy_gradient_is_the_vanilla_policy_gradient():
    # On-policy r = 1 and g'(1) = 4 sigmoid'(0) = 1, so d loss / d logp = -A for either sign.
    logprobs = torch.tensor([[-0.7, -1.3]], requires_grad=True)
    log_ratio = logprobs - logprobs.detach()
    term = sapo_loss(log_ratio, torch.tensor([[2.0, -3.0]]), 1.0, 1.05)
    term.loss_B_T.sum().backward()
    close(logprobs.grad, [[-2.0, 3.0]])


# --------------------------------------------------------------------------- luspo


def test_luspo_gives_every_token_the_same_on_policy_gradient_whatever_its_sequence_length():
    # Sequence 0 has 2 tokens with A=+1; sequence 1 has 1 token with A=-1; num_items 3.
    # Sequence losses l_i = -A_i, scaled by length: (2 * -1 + 1 * 1) / 3 = -1/3.
    # Each token gets d/dlogp = |y| * (-A * 1/|y|) / 3 = -A/3 (GSPO alone would give -A/(2|y|)).
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    config = LossConfig(loss_type="luspo", importance_sampling_level="sequence")
    out = policy_loss(
        logprobs, logprobs.detach(), torch.tensor([1.0, -1.0]), mask, config, num_items=3
    )
    close(out.loss, -1 / 3)
    out.loss.backward()
    close(logprobs.grad, [[-1 / 3, -1 / 3], [1 / 3, 0.0]])


def test_luspo_with_token_level_ratios_is_dapos_token_sum_as_in_trl():
    # TRL trains luspo at the default token level (and warns); each sequence's mean times its
    # length is then its token sum, so the loss is dapo's.
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    old, mask = logprobs - 0.1, torch.tensor([[1, 1], [1, 0]])
    advantages = torch.tensor([1.0, -1.0])
    luspo, dapo = (LossConfig(loss_type=name) for name in ("luspo", "dapo"))
    close(
        policy_loss(logprobs, old, advantages, mask, luspo, num_items=3).loss,
        policy_loss(logprobs, old, advantages, mask, dapo, num_items=3).loss,
    )


# --------------------------------------------------------------------------- KL


def test_kl_k3_at_known_points():
    # d = ref - logp. logp = ln .5, ref = ln .25: d = -ln 2, exp(d) - d - 1 = 0.5 + 0.693147 - 1.
    # logp = ln .25, ref = ln .5: d = ln 2, 2 - 0.693147 - 1.
    logp = torch.tensor([0.5, 0.25, 0.3]).log()
    ref = torch.tensor([0.25, 0.5, 0.3]).log()
    close(kl_k3(logp, ref), [0.5 + LN2 - 1, 1 - LN2, 0.0])


def kl_only_loss(bias_correction: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and gradient of a 1-token on-policy batch with A = 0, beta = 1: only the KL is left."""
    logprobs = torch.tensor([[math.log(0.5)]], requires_grad=True)
    config = LossConfig(beta=1.0, use_bias_correction_kl=bias_correction)
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([0.0]),
        torch.ones(1, 1),
        config,
        ref_logprobs_B_T=torch.tensor([[math.log(0.25)]]),
        num_items=1,
    )
    out.loss.backward()
    return out.loss, logprobs.grad


def test_bias_corrected_kl_has_the_same_value_but_a_different_gradient_on_policy():
    # Value on-policy (r = 1): k3 = 0.5 + ln 2 - 1 either way.
    # Plain k3: d/dlogp = 1 - exp(ref - logp) = 1 - 0.5 = 0.5.
    # Times r = exp(logp - old): adds k3 * 1, so 0.5 + (0.5 + ln 2 - 1) = ln 2 = logp - ref.
    plain_loss, plain_grad = kl_only_loss(False)
    corrected_loss, corrected_grad = kl_only_loss(True)
    close(plain_loss, 0.5 + LN2 - 1)
    close(corrected_loss, 0.5 + LN2 - 1)
    close(plain_grad, [[0.5]])
    close(corrected_grad, [[LN2]])


def test_sampler_weights_scale_the_policy_term_but_not_the_kl():
    # On-policy, A = 1: policy term -1, times weight 0.5 = -0.5; KL 0.1 * (0.5 + ln 2 - 1).
    logprobs = torch.tensor([[math.log(0.5)]], requires_grad=True)
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([1.0]),
        torch.ones(1, 1),
        LossConfig(beta=0.1),
        ref_logprobs_B_T=torch.tensor([[math.log(0.25)]]),
        sampler_weights_B_T=torch.tensor([[0.5]]),
        num_items=1,
    )
    close(out.loss, -0.5 + 0.1 * (0.5 + LN2 - 1))
    close(out.metrics["kl"], 0.5 + LN2 - 1)


def test_a_kl_penalty_without_reference_logprobs_is_refused():
    logprobs = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="ref_logprobs_B_T"):
        policy_loss(
            logprobs, logprobs, torch.zeros(1), torch.ones(1, 1), LossConfig(beta=0.1), num_items=1
        )


# --------------------------------------------------------------------------- sampler mismatch

# old - sampler (per token): row 0 [ln 4, ln 0.25, ln 100 (padding)], row 1 [ln 2, ln 8, ln 0.5].
SAMPLER = torch.full((2, 3), -1.0)
OLD = SAMPLER + torch.tensor([[4.0, 0.25, 100.0], [2.0, 8.0, 0.5]]).log()
SAMPLER_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_token_truncate_clamps_each_ratio_and_zeroes_padding():
    weights = sampler_correction(OLD, SAMPLER, SAMPLER_MASK, "token_truncate", clip_max=3.0)
    close(weights, [[3.0, 0.25, 0.0], [2.0, 3.0, 0.5]])
    weights = sampler_correction(OLD, SAMPLER, SAMPLER_MASK, "token_truncate", 3.0, clip_min=0.6)
    close(weights, [[3.0, 0.6, 0.0], [2.0, 3.0, 0.6]])


def test_token_mask_zeroes_ratios_outside_the_bounds():
    # Kept: 0.5 <= r <= 3 (inclusive). Row 0: 4 out, 0.25 out. Row 1: 2 in, 8 out, 0.5 in.
    weights = sampler_correction(OLD, SAMPLER, SAMPLER_MASK, "token_mask", 3.0, clip_min=0.5)
    close(weights, [[0.0, 0.0, 0.0], [2.0, 0.0, 0.5]])


def test_sequence_modes_use_the_exp_of_the_mean_log_ratio():
    # Row 0: (ln 4 + ln 0.25) / 2 = 0 -> ratio 1.
    # Row 1: (ln 2 + ln 8 + ln 0.5) / 3 = ln 8 / 3 = ln 2 -> ratio 2.
    weights = sampler_correction(OLD, SAMPLER, SAMPLER_MASK, "sequence_truncate", clip_max=1.5)
    close(weights, [[1.0, 1.0, 0.0], [1.5, 1.5, 1.5]])
    weights = sampler_correction(OLD, SAMPLER, SAMPLER_MASK, "sequence_mask", clip_max=1.5)
    close(weights, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    weights = sampler_correction(OLD, SAMPLER, SAMPLER_MASK, "sequence_mask", None, clip_min=1.5)
    close(weights, [[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]])


def test_sampler_weights_are_detached_and_unknown_modes_refused():
    old = OLD.clone().requires_grad_()
    assert not sampler_correction(old, SAMPLER, SAMPLER_MASK, "token_mask", 3.0).requires_grad
    with pytest.raises(ValueError, match="sequence_truncate"):
        sampler_correction(OLD, SAMPLER, SAMPLER_MASK, "token_clip", 3.0)


def test_off_policy_masking_drops_only_negative_sequences_that_drifted_past_the_threshold():
    # sampler - logprobs, masked mean per sequence (padding holds a huge 50 that must not count):
    # seq 0: (1 + 1) / 2 = 1.0 > 0.5 and A < 0 -> dropped.
    # seq 1: (0.2 + 0.2) / 2 = 0.2 <= 0.5      -> kept.
    # seq 2: 1.0 > 0.5 but A > 0                 -> kept.
    logprobs = torch.tensor([[-2.0, -2.0, -60.0], [-1.2, -1.2, -60.0], [-2.0, -2.0, -60.0]])
    sampler = torch.tensor([[-1.0, -1.0, -10.0], [-1.0, -1.0, -10.0], [-1.0, -1.0, -10.0]])
    mask = torch.tensor([[1, 1, 0]] * 3)
    keep_B = off_policy_sequence_mask(logprobs, sampler, torch.tensor([-1.0, -1.0, 1.0]), mask, 0.5)
    assert keep_B.tolist() == [False, True, True]


# --------------------------------------------------------------------------- entropy


def test_entropy_from_logits_matches_hand_computed_distributions():
    # Uniform over 4: ln 4. Probabilities [0.75, 0.25] (logits [ln 3, 0]):
    # -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.215762 + 0.346574 = 0.562335.
    # Three rows with chunk_size 2 also checks that the chunks are stitched back in order.
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0]],
            [[math.log(3), 0.0, -1e9, -1e9]],
            [[0.0, 0.0, 0.0, 0.0]],
        ]
    )
    close(entropy_from_logits(logits, chunk_size=2), [[math.log(4)], [0.562335], [math.log(4)]])


# Active entropies 1, 2, 3, 4, 5; the padded 9 must never be kept nor move the threshold.
ENTROPY = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])
ENTROPY_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_top_entropy_quantile_one_keeps_every_active_token():
    assert top_entropy_mask(ENTROPY, ENTROPY_MASK, 1.0).tolist() == [[1, 1, 1], [1, 1, 0]]


def test_top_entropy_quantile_zero_keeps_only_the_highest():
    assert top_entropy_mask(ENTROPY, ENTROPY_MASK, 0.0).tolist() == [[0, 0, 0], [0, 1, 0]]


def test_top_entropy_quantile_half_keeps_tokens_at_or_above_the_median():
    # Median of 1..5 is 3.
    assert top_entropy_mask(ENTROPY, ENTROPY_MASK, 0.5).tolist() == [[0, 0, 1], [1, 1, 0]]


# --------------------------------------------------------------------------- policy_loss


def test_dapo_on_policy_loss_is_minus_the_advantage_sum_over_num_items():
    # A = [2, -1]; active tokens: 2 in row 0, 1 in row 1; num_items = 6 (the global batch).
    # Loss = -(2 * 2 + -1 * 1) / 6 = -0.5. Gradient -A / 6 at active tokens, 0 elsewhere.
    logprobs = torch.tensor([[-0.5, -1.5, -2.0], [-0.3, -0.1, -4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = policy_loss(
        logprobs, logprobs.detach(), torch.tensor([2.0, -1.0]), mask, LossConfig(), num_items=6
    )
    close(out.loss, -0.5)
    out.loss.backward()
    close(logprobs.grad, [[-1 / 3, -1 / 3, 0.0], [1 / 6, 0.0, 0.0]])


def per_token_objective(config: LossConfig, logprobs, old, advantages, mask) -> torch.Tensor:
    """The objective of config.loss_type per token, built from the public functions alone."""
    log_ratio = log_importance_ratio(logprobs, old, mask, config.importance_sampling_level)
    advantages_B_1 = advantages.unsqueeze(-1)
    if config.loss_type == "cispo":
        return cispo_loss(log_ratio, advantages_B_1, logprobs, config.epsilon_high).loss_B_T
    if config.loss_type == "sapo":
        temperatures = (config.sapo_temperature_pos, config.sapo_temperature_neg)
        return sapo_loss(log_ratio, advantages_B_1, *temperatures).loss_B_T
    epsilons = (config.epsilon_low, config.epsilon_high)
    return clipped_surrogate_loss(log_ratio, advantages_B_1, *epsilons).loss_B_T


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(loss_type="grpo"),
        LossConfig(loss_type="bnpo"),
        LossConfig(loss_type="dr_grpo", max_completion_length=8),
        LossConfig(loss_type="dapo"),
        LossConfig(loss_type="cispo", epsilon_high=5.0),
        LossConfig(loss_type="sapo"),
        LossConfig(loss_type="luspo", importance_sampling_level="sequence"),
    ],
    ids=lambda config: config.loss_type,
)
def test_policy_loss_reduces_its_per_token_loss_with_aggregate(config):
    # Off-policy, rows of 2 and 1 active tokens, num_items 7: grpo, bnpo, dr_grpo and the
    # num_items normalisers each give a different number here, so policy_loss normalising any
    # other way than aggregate would show.
    logprobs = torch.tensor([[-0.5, -1.5, 0.0], [-0.3, 0.0, 0.0]])
    old = torch.tensor([[-0.6, -1.2, 0.0], [-0.2, 0.0, 0.0]])
    advantages = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = policy_loss(logprobs, old, advantages, mask, config, num_items=7)
    per_token = per_token_objective(config, logprobs, old, advantages, mask)
    expected = aggregate(
        per_token,
        mask,
        config.loss_type,
        num_items=7,
        max_completion_length=config.max_completion_length,
    )
    close(out.loss, expected.item())


CONFIGS = {
    "grpo": LossConfig(loss_type="grpo"),
    "bnpo": LossConfig(loss_type="bnpo"),
    "dr_grpo": LossConfig(loss_type="dr_grpo", max_completion_length=8),
    "dapo": LossConfig(loss_type="dapo", delta=2.0, beta=0.1),
    "cispo": LossConfig(loss_type="cispo", epsilon_high=5.0, beta=0.1),
    "sapo": LossConfig(loss_type="sapo", entropy_coef=0.01),
    "luspo": LossConfig(loss_type="luspo", importance_sampling_level="sequence", beta=0.1),
    "gspo": LossConfig(loss_type="grpo", importance_sampling_level="sequence"),
}


def loss_and_grad(config: LossConfig, masked_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and gradient on a fixed off-policy batch whose masked positions hold masked_value.

    Every per-token input (logprobs, old, ref, sampler weights, entropies) holds it there.
    """
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    padded = mask == 0

    def tokens(values: list[list[float]]) -> torch.Tensor:
        return torch.tensor(values).masked_fill(padded, masked_value)

    logprobs = tokens([[-0.5, -1.5, 0.0], [-0.3, 0.0, 0.0]]).requires_grad_()
    out = policy_loss(
        logprobs,
        tokens([[-0.6, -1.2, 0.0], [-0.2, 0.0, 0.0]]),
        torch.tensor([1.0, -2.0]),
        mask,
        config,
        ref_logprobs_B_T=tokens([[-0.4, -1.0, 0.0], [-0.6, 0.0, 0.0]]),
        sampler_weights_B_T=tokens([[1.0, 0.9, 0.0], [1.1, 0.0, 0.0]]),
        num_items=5,
        entropy_B_T=tokens([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]),
    )
    out.loss.backward()
    return out.loss, logprobs.grad


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_masked_out_tokens_logprob_changes_neither_loss_nor_gradient(name):
    loss, grad = loss_and_grad(CONFIGS[name], masked_value=0.0)
    for masked_value in (100.0, -100.0, float("-inf"), float("inf"), float("nan")):
        other_loss, other_grad = loss_and_grad(CONFIGS[name], masked_value)
        assert other_loss.item() == loss.item()
        assert torch.equal(other_grad, grad)
    assert grad[0, 2].item() == 0.0 and grad[1, 1].item() == 0.0 and grad[1, 2].item() == 0.0
    assert grad[0, 0].item() != 0.0  # the active tokens do get a gradient


def test_clip_metrics_are_fractions_of_active_tokens():
    # Row 0, A=+1: r = 1.5 (clipped high), 0.5 (not). Row 1, A=-1: r = 0.5 (clipped low), 1.5
    # (not). Row 2, A=+1: r = 1 on its active token; its padded token (r = 1.5) must not count.
    logprobs = torch.tensor([[1.5, 0.5], [0.5, 1.5], [1.5, 1.5]]).log()
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    advantages = torch.tensor([1.0, -1.0, 1.0])
    config = LossConfig(epsilon_low=0.2, epsilon_high=0.28)
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0], [math.log(1.5), 0.0]])
    out = policy_loss(logprobs, old, advantages, mask, config, num_items=5)
    # 5 active tokens: low 1/5, high 1/5, region 2/5.
    close(out.metrics["clip_ratio/low_mean"], 0.2)
    close(out.metrics["clip_ratio/high_mean"], 0.2)
    close(out.metrics["clip_ratio/region_mean"], 0.4)
    assert all(not value.requires_grad for value in out.metrics.values())


def test_entropy_bonus_subtracts_coef_times_the_mean_active_entropy():
    # A = 0 on-policy: policy term 0. Entropies 1 and 3 active (mean 2), 100 padded.
    logprobs = torch.zeros(1, 3, requires_grad=True)
    entropy = torch.tensor([[1.0, 3.0, 100.0]], requires_grad=True)
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.zeros(1),
        torch.tensor([[1, 1, 0]]),
        LossConfig(loss_type="grpo", entropy_coef=0.1),
        entropy_B_T=entropy,
    )
    close(out.loss, -0.2)
    close(out.metrics["entropy"], 2.0)
    out.loss.backward()
    close(entropy.grad, [[-0.05, -0.05, 0.0]])


# --------------------------------------------------------------------------- LossConfig


def test_an_unknown_loss_type_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'bnpo', 'cispo', 'dapo', 'dr_grpo', 'grpo'"):
        LossConfig(loss_type="ppo")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"loss_type": "cispo", "epsilon_high": 0.0}, "absolute cap"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"loss_type": "sapo", "delta": 2.0}, "delta applies"),
        ({"delta": 0.5}, "delta"),
        ({"beta": -0.1}, "beta"),
        ({"importance_sampling_level": "episode"}, "importance_sampling_level"),
    ],
)
def test_inconsistent_loss_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**fields)
