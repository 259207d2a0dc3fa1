"""GRPOTrainer arguments in the spellings that older TRL scripts and Unsloth-style cards use.

Such a card builds the trainer as ``GRPOTrainer(model=..., args=..., train_dataset=...,
tokenizer=tokenizer, reward_fn=reward_fn)``, passes ``num_generations`` to the trainer, and
asks for ``optim="adamw_8bit"``. Each of these maps onto one of today's arguments here, and
every conflict between an old spelling and a new one is an error saying which to keep.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from agentgrpo.config import GRPOConfig

logger = logging.getLogger(__name__)

# transformers' `optim` names that are bitsandbytes optimizers.
BITSANDBYTES_OPTIMIZERS = frozenset(
    {
        "adamw_bnb_8bit",
        "adamw_8bit",
        "paged_adamw_32bit",
        "paged_adamw_8bit",
        "ademamix",
        "ademamix_8bit",
        "paged_ademamix_32bit",
        "paged_ademamix_8bit",
        "lion_32bit",
        "lion_8bit",
        "paged_lion_32bit",
        "paged_lion_8bit",
        "rmsprop_bnb",
        "rmsprop_bnb_8bit",
        "rmsprop_bnb_32bit",
    }
)


def processing_class_of(processing_class: Any, tokenizer: Any) -> Any:
    """The tokenizer: `processing_class`, or `tokenizer`, its older name.

    Raises:
        ValueError: Both are given.
    """
    if tokenizer is None:
        return processing_class
    if processing_class is not None:
        raise ValueError(
            "processing_class and tokenizer are the new and the old name of one argument, and "
            "both are given; pass only processing_class"
        )
    return tokenizer


def reward_sources(reward_funcs: Any, reward_model: Any, reward_fn: Any) -> list[Any]:
    """`reward_funcs` as a list, followed by `reward_model` and `reward_fn` when given."""
    if reward_funcs is None:
        funcs = []
    else:
        funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    return funcs + [source for source in (reward_model, reward_fn) if source is not None]


# Loss types whose value is a sum over tokens (normalised by a token count or a constant): with a
# sequence-level ratio they weight each sequence by its length (TRL warns about the same four).
TOKEN_SUMMED_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")


def loss_setting_warnings(loss_type: str, importance_sampling_level: str) -> list[str]:
    """The warnings TRL 1.16's trainer logs about a loss type and a ratio level, in its words.

    Examples:
        >>> loss_setting_warnings("grpo", "sequence")
        []
        >>> [text] = loss_setting_warnings("luspo", "token")
        >>> text.startswith("When using `'luspo'` loss, `importance_sampling_level` should be")
        True

    """
    warnings = []
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        warnings.append(
            "When using `'luspo'` loss, `importance_sampling_level` should be set to "
            "`'sequence'` to mirror the paper's setup."
        )
    if loss_type == "vespo" and importance_sampling_level != "token":
        warnings.append(
            "VESPO computes sequence-level importance weights internally. "
            "`importance_sampling_level` should be set to `'token'` (the default)."
        )
    if importance_sampling_level == "sequence" and loss_type in TOKEN_SUMMED_LOSSES:
        warnings.append(
            f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums "
            "per-token contributions, which effectively weights each sequence by its completion "
            "length instead of optimizing the per-sequence objective. To reproduce the GSPO "
            "paper's setup, set `loss_type='grpo'` (see "
            "https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization)."
        )
    return warnings


def warn_about_loss_settings(args: GRPOConfig) -> None:
    """Log `loss_setting_warnings` of a `GRPOConfig` through this module's logger, as TRL does."""
    for text in loss_setting_warnings(args.loss_type, args.importance_sampling_level):
        logger.warning(text)


CONTINUOUS_BATCHING_NOTE = (
    "use_transformers_continuous_batching=True: agentgrpo's transformers backend batches "
    "continuously already (a request joins the running batch at its next decoding step), so it "
    "generates as usual; transformers' own engine and transformers_continuous_batching_config "
    "are not used. Set use_vllm=True for vLLM."
)


def warn_about_generation_settings(args: GRPOConfig) -> None:
    """Log what generates when a TRL config asks for transformers' continuous batching."""
    if args.use_transformers_continuous_batching and not args.use_vllm:
        logger.warning(CONTINUOUS_BATCHING_NOTE)


def check_arguments(args: GRPOConfig, num_generations: int | None) -> None:
    """Check the trainer's `num_generations` and the optimizer; warn about loss and generation.

    Raises:
        ValueError: `num_generations` differs from the config's (`check_num_generations`).
        ImportError: `args.optim` needs bitsandbytes (`check_optimizer`).
    """
    check_num_generations(args.num_generations, num_generations)
    warn_about_loss_settings(args)
    warn_about_generation_settings(args)
    check_optimizer(args.optim, args.device)


def default_config(model: Any, num_generations: int | None) -> GRPOConfig:
    """TRL's default config: written to `<model name>-GRPO`, with `num_generations` if given."""
    group: dict[str, Any] = {} if num_generations is None else {"num_generations": num_generations}
    return GRPOConfig(output_dir=f"{model_name(model)}-GRPO", **group)


def model_name(model: Any) -> str:
    """The last part of the model's name or path (TRL names the output folder after it)."""
    name = model if isinstance(model, str) else model.config._name_or_path
    return str(name).rstrip("/").split("/")[-1] or "model"


def check_num_generations(config_value: int, trainer_value: int | None) -> None:
    """Fail when `num_generations` passed to the trainer differs from the config's.

    Raises:
        ValueError: The two values differ.
    """
    if trainer_value is not None and trainer_value != config_value:
        raise ValueError(
            f"GRPOTrainer(num_generations={trainer_value}) differs from the config's "
            f"num_generations={config_value}; the group size is a GRPOConfig setting: set "
            f"GRPOConfig(num_generations={trainer_value}) or drop the trainer argument"
        )


def check_optimizer(optim: Any, device: torch.device) -> None:
    """Fail now, before any model work, when `optim` needs bitsandbytes and it cannot run.

    A bitsandbytes optimizer is tried for one step on a tensor of 4096 elements (the size from
    which it keeps 8-bit state) on `device`, so a build without kernels for that device is
    caught here too, not at the first training step.

    Raises:
        ImportError: bitsandbytes is missing, or fails on `device`; the message says what to do.
    """
    name = str(getattr(optim, "value", optim))
    if name not in BITSANDBYTES_OPTIMIZERS:
        return
    fix = "install it (`pip install bitsandbytes`) or choose optim='adamw_torch'"
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(
            f"optim={name!r} is a bitsandbytes optimizer, and bitsandbytes is not installed: {fix}"
        ) from error
    try:
        probe = torch.nn.Parameter(torch.zeros(4096, device=device))
        probe.grad = torch.ones_like(probe)
        bitsandbytes.optim.AdamW8bit([probe]).step()
    except Exception as error:
        raise ImportError(
            f"optim={name!r} needs bitsandbytes, which is installed but fails on {device} "
            f"({type(error).__name__}: {error}); upgrade it or choose another optimizer, e.g. "
            "optim='adamw_torch'"
        ) from error
