"""The checks of a `GRPOConfig` that span its field groups, and its normalized spellings.

Each field group's own checks live beside its fields (`batching`, `vllm`, `loss`, `episodes`,
`warm_start`); `check_values` and `check_combinations` call them. A failed check is a
ValueError that says what to change (`errors.require`).
"""

import math
import warnings
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from agentgrpo.config.batching import MAX_BATCH
from agentgrpo.config.episodes import check_episode_values, check_template_and_parser
from agentgrpo.config.errors import require
from agentgrpo.config.loss import (
    LOSS_TYPES,
    check_importance_sampling_bounds,
    check_loss_combinations,
)
from agentgrpo.config.vllm import check_vllm
from agentgrpo.config.warm_start import check_warm_start

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig

# Fields whose value must be one of a fixed set (checked after `scale_rewards` is normalized).
_CHOICES: dict[str, tuple[str, ...]] = {
    "scale_rewards": ("group", "batch", "none"),
    "loss_type": LOSS_TYPES,
    "importance_sampling_level": ("token", "sequence"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "vllm_mode": ("colocate", "server"),
    "vllm_model_impl": ("vllm", "transformers"),
    "vllm_importance_sampling_mode": (
        "token_truncate",
        "token_mask",
        "sequence_truncate",
        "sequence_mask",
    ),
}

_SCALE_REWARDS_ALIASES = {"true": "group", "false": "none"}
# Fields a negative value makes meaningless (a negative learning rate climbs the loss).
_NOT_NEGATIVE = ("learning_rate", "beta", "temperature", "warm_start_learning_rate")


def normalize(config: "GRPOConfig") -> None:
    """Turn accepted spellings into the single value the rest of agentgrpo reads."""
    config.scale_rewards = _SCALE_REWARDS_ALIASES.get(
        str(config.scale_rewards).lower(), config.scale_rewards
    )
    if config.epsilon_high is None:
        config.epsilon_high = config.epsilon
    if config.gradient_checkpointing:  # as TRL and transformers 5 default to
        kwargs = dict(config.gradient_checkpointing_kwargs or {})  # type: ignore[arg-type]
        config.gradient_checkpointing_kwargs = {"use_reentrant": False, **kwargs}
    if isinstance(config.pad_to_multiple_of, str) and config.pad_to_multiple_of != "auto":
        # The command line delivers every value as text.
        text = config.pad_to_multiple_of.lower()
        config.pad_to_multiple_of = None if text in ("none", "null") else int(text)
    if config.pad_to_multiple_of == "auto":
        config.pad_to_multiple_of = 128 if config.device.type == "neuron" else None
    if config.vllm_guided_decoding_regex is not None:
        require(
            config.vllm_structured_outputs_regex in (None, config.vllm_guided_decoding_regex),
            "vllm_guided_decoding_regex and vllm_structured_outputs_regex are two names for "
            "one setting and differ here; set only vllm_structured_outputs_regex.",
        )
        config.vllm_structured_outputs_regex = config.vllm_guided_decoding_regex
    if config.vllm_importance_sampling_cap is not None:
        warnings.warn(
            "vllm_importance_sampling_cap is deprecated; use "
            "vllm_importance_sampling_clip_max instead (it now takes the cap's value).",
            FutureWarning,
            stacklevel=5,  # the caller of GRPOConfig(...)
        )
        config.vllm_importance_sampling_clip_max = config.vllm_importance_sampling_cap
    if config.use_transformers_paged:
        warnings.warn(
            "`use_transformers_paged` is deprecated and will be removed in v2.0.0. Use "
            "`use_transformers_continuous_batching` instead.",
            FutureWarning,
            stacklevel=5,  # the caller of GRPOConfig(...)
        )
        config.use_transformers_continuous_batching = True


def check_numbers(config: "GRPOConfig") -> None:
    """Refuse NaN, infinity, negative rates and a group too large to hold in memory.

    Every number field is checked, and every number in a list field. Neither NaN nor
    infinity is a setting: `learning_rate=inf` or `beta=nan` would train every weight to
    NaN and still exit cleanly. A limit is lifted with None, never inf.
    """
    for item in fields(config):
        value = getattr(config, item.name, None)
        numbers = value if isinstance(value, list | tuple) else [value]
        for number in numbers:
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(_not_finite(item, number, alone=number is value))
    for name in _NOT_NEGATIVE:
        require(
            getattr(config, name) >= 0,
            f"{name}={getattr(config, name)} is negative; it must be >= 0.",
        )
    require(
        config.num_generations is None or config.num_generations <= MAX_BATCH,
        f"num_generations={config.num_generations} is above {MAX_BATCH}, the most episodes "
        "agentgrpo holds in memory for one step; lower it.",
    )


def check_values(config: "GRPOConfig") -> None:
    """Check each field on its own: choices, ranges and unsupported features."""
    for name, valid in _CHOICES.items():
        if getattr(config, name) not in valid:
            choices = ", ".join(repr(v) for v in valid)
            raise ValueError(f"{name}={getattr(config, name)!r} is not one of {choices}.")
    require(
        config.num_generations is not None and config.num_generations >= 2,
        "GRPO requires at least 2 generations per prompt to calculate the advantages. You "
        f"provided {config.num_generations}, which is less than the minimum required: set "
        "num_generations >= 2.",
    )
    require(
        config.num_generations_eval is None or config.num_generations_eval >= 1,
        f"num_generations_eval={config.num_generations_eval} must be at least 1 (or None).",
    )
    require(
        config.max_completion_length is not None,
        "max_completion_length=None: every episode needs a budget of completion tokens (its "
        "model and tool turns count against it), where TRL leaves it to the generator's own "
        "limit. Set a number of tokens (the default is 512).",
    )
    require(
        config.max_completion_length is not None and config.max_completion_length >= 1,
        f"max_completion_length={config.max_completion_length} must be at least 1.",
    )
    require(
        config.entropy_coef_min <= config.entropy_coef_max and config.entropy_coef_delta >= 0,
        f"adaptive entropy control needs entropy_coef_min ({config.entropy_coef_min}) <= "
        f"entropy_coef_max ({config.entropy_coef_max}) and entropy_coef_delta "
        f"({config.entropy_coef_delta}) >= 0.",
    )
    require(
        0.0 <= config.top_entropy_quantile <= 1.0,
        f"top_entropy_quantile={config.top_entropy_quantile} must be in [0, 1].",
    )
    require(
        config.max_tool_calling_iterations is None or config.max_tool_calling_iterations >= 0,
        f"max_tool_calling_iterations={config.max_tool_calling_iterations} must be >= 0.",
    )
    check_episode_values(config)
    check_warm_start(config)
    check_template_and_parser(config)


def check_combinations(config: "GRPOConfig") -> None:
    """Check fields that only fail together."""
    # TRL raises this in its trainer; it is a config mistake, so it is caught here.
    require(
        not (config.sync_ref_model and config.beta == 0.0),
        "You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model "
        "is not used during training: set beta > 0 or sync_ref_model=False.",
    )
    require(
        config.log_completions_hub_repo is None or config.log_completions,
        "log_completions_hub_repo is set, but log_completions is False. Enable "
        "log_completions to upload completions to the Hub, or unset log_completions_hub_repo.",
    )
    require(
        not config.auto_find_batch_size,
        "auto_find_batch_size is not supported by GRPO, because the generation batch must "
        "contain full prompt groups of num_generations completions; lower "
        "per_device_train_batch_size instead.",
    )
    parallel = config.parallelism_config
    require(
        parallel is None or not (parallel.cp_enabled or parallel.sp_enabled),
        "GRPOTrainer does not support sequence-dim parallelism (`parallelism_config.cp_size "
        "> 1` or `parallelism_config.sp_size > 1`) yet. Set both `cp_size=1` and `sp_size=1`.",
    )
    check_importance_sampling_bounds(config)
    check_loss_combinations(config)
    if config.use_vllm:
        check_vllm(config)


def _not_finite(item: Any, number: float, alone: bool) -> str:
    """Why `number`, the value of field `item` (or an element of it), is refused."""
    if math.isnan(number):
        what = "not a number"
    else:
        what = "infinite (a number too large for a float, such as 1e400, reads as inf)"
    lifted = alone and "None" in str(item.type)
    return f"{item.name}={number} is {what}; give a finite value" + (
        ", or None for no limit." if lifted else "."
    )
