"""`GRPOConfig` fields of the learner: the loss, the advantages, and off-policy corrections."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require
from agentgrpo.precision import corrects_sampler_mismatch

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig

# Every loss TRL 1.16 names. Which of them agentgrpo implements is decided in one place, the loss
# module's dispatch table, which refuses the others when the trainer is built; listing them all
# here keeps TRL configs loadable and avoids a second list that could drift from the first.
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


@dataclass
class LossFields:
    """The policy loss, its clipping, the KL penalty, rewards into advantages, entropy."""

    beta: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the KL penalty to the reference model. 0.0: no reference model "
            "is loaded."
        },
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Optimization passes over each generation batch (mu in the paper)."},
    )
    epsilon: float = field(
        default=0.2, metadata={"help": "Lower clipping bound of the ratio: 1 - epsilon."}
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Upper bound on the ratio for two-sided clipping (INTELLECT-2); should "
            "exceed 1 + epsilon. None: one-sided clipping."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clipping bound: 1 + epsilon_high. None: epsilon. DAPO suggests 0.28; "
            "for 'cispo' it is the cap on the weight itself (ScaleRL suggests 5.0)."
        },
    )
    sapo_temperature_neg: float = field(
        default=1.05,
        metadata={"help": "'sapo' gate temperature for tokens with advantage <= 0."},
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "'sapo' gate temperature for tokens with advantage > 0."}
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={"help": "'vespo' power exponent for positive advantages (ratio below 1)."},
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={"help": "'vespo' decay for positive advantages (ratio above 1)."},
    )
    vespo_k_neg: float = field(
        default=3.0,
        metadata={"help": "'vespo' power exponent for negative advantages (ratio below 1)."},
    )
    vespo_lambda_neg: float = field(
        default=2.0,
        metadata={"help": "'vespo' decay for negative advantages (ratio above 1)."},
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token': one policy ratio per token. 'sequence': one per completion, from "
            "the mean token log-ratio (GSPO)."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward function (the trainer checks the count). None: all 1.0."
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize': weight and sum the rewards, then scale. "
            "'normalize_then_sum': scale each reward within its group, then weight and sum "
            "(GDPO)."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Divide advantages by the reward std of the 'group' (or True), of the "
            "'batch', or not at all: 'none' (or False), as Dr. GRPO advises."
        },
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Policy loss: 'dapo' (tokens averaged over the global batch), 'grpo' (per "
            "sequence, then per batch), 'dr_grpo' (divided by a constant), 'bnpo' (tokens "
            "averaged over the local batch), 'cispo', 'sapo', 'luspo' or 'vespo' (a smooth "
            "Gamma-kernel weight of the sequence importance ratio, vespo_k_* and vespo_lambda_*)."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Leave completions cut off by a limit out of the loss (DAPO)."},
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Move the reference model toward the policy every ref_model_sync_steps "
            "(TR-DPO). Needs beta > 0."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={"help": "Mix of a reference sync: ref = alpha * policy + (1 - alpha) * ref."},
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "Optimizer steps between reference syncs."}
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Fraction of tokens, by entropy, kept in the policy loss, in [0, 1]. 1.0 "
            "keeps all; 0.0 only the highest-entropy token."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={"help": "Weight of a mean per-token entropy bonus in the loss; 0.0 disables it."},
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Adaptive entropy control (Skywork-OR1): after each optimizer step, raise "
            "entropy_coef by entropy_coef_delta when the step's mean token entropy is at or "
            "below entropy_target, else lower it, within [entropy_coef_min, entropy_coef_max]; "
            "the bonus applies only while entropy is at or below the target."
        },
    )
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "Adaptive entropy control: lowest entropy_coef."}
    )
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "Adaptive entropy control: highest entropy_coef."}
    )
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Adaptive entropy control: step of entropy_coef."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={"help": "Adaptive entropy control: target mean token entropy, in nats."},
    )


@dataclass
class OffPolicyFields:
    """Corrections for tokens the sampler drew with other numerics or older weights."""

    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Reweight the loss by training/sampler probability ratios to correct for the "
            "sampler's numerics: vLLM's, or generation under bf16/fp16 mixed precision."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "How the correction treats ratios outside [clip_min, clip_max]: "
            "'*_truncate' clamps, '*_mask' zeroes; 'token_*' per token, 'sequence_*' per "
            "sequence."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={"help": "Upper bound of the correction ratio. None: no upper bound."},
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={"help": "Lower bound of the correction ratio. None: no lower bound."},
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Drop sequences with negative advantage whose KL to the sampler exceeds "
            "this (DeepSeek-V3.2, e.g. 0.5). None disables it."
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the KL term by the policy ratio so its gradient is the unbiased "
            "reverse-KL gradient (DeepSeek-V3.2)."
        },
    )


def check_loss_combinations(config: "GRPOConfig") -> None:
    """Refuse what cannot work; the trainer logs TRL's warnings (`porting`)."""
    require(
        not (
            config.loss_type == "vespo"
            and corrects_sampler_mismatch(config)
            and not config.vllm_importance_sampling_mode.startswith("token_")
        ),
        "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
        f"'token_mask'. Got: {config.vllm_importance_sampling_mode}. (Its sequence weight takes "
        "per-token corrections; or set vllm_importance_sampling_correction=False.)",
    )


def check_importance_sampling_bounds(config: "GRPOConfig") -> None:
    """Check the sampler-correction bounds: ordered, and one set when a mode truncates."""
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    require(
        low is None or high is None or low < high,
        f"vllm_importance_sampling_clip_min ({low}) must be less than "
        f"vllm_importance_sampling_clip_max ({high}).",
    )
    truncates = config.vllm_importance_sampling_mode.endswith("_truncate")
    require(
        not (config.vllm_importance_sampling_correction and truncates)
        or low is not None
        or high is not None,
        "At least one of `vllm_importance_sampling_clip_min` or `vllm_importance_sampling_"
        "clip_max` must be set when `vllm_importance_sampling_mode` is a `*_truncate` mode.",
    )
