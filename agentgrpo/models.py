"""Loading the policy, its tokenizer and the reference model, as GRPOTrainer's arguments allow."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, TrainerCallback


def load_policy(model: str | PreTrainedModel, args: Any, peft_config: Any = None) -> Any:
    """The model to train: a hub id or local path is loaded, a model is used as given.

    Args:
        model: A hub id or local folder, a `PreTrainedModel`, or a `PeftModel`.
        args: The `GRPOConfig` (`model_init_kwargs`, `disable_dropout`, `cast_lm_head_to_fp32`,
            `gradient_checkpointing`).
        peft_config: A PEFT config; the model is wrapped with it (LoRA and friends).
    """
    policy: Any = model  # a PreTrainedModel, a PeftModel, or loaded from a name just below
    if isinstance(model, str):
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("dtype", "auto")
        policy = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    elif args.model_init_kwargs:
        raise ValueError(
            "model_init_kwargs only applies when model is a name or path; "
            "the model you passed is already loaded"
        )
    if peft_config is not None:
        from peft import get_peft_model

        policy = get_peft_model(policy, peft_config)
    if args.disable_dropout:
        disable_dropout(policy)
    if args.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(policy)
    if args.gradient_checkpointing and hasattr(policy, "enable_input_require_grads"):
        policy.enable_input_require_grads()  # checkpointed LoRA needs grads at the inputs
    return policy


def router_aux_loss_coef(model: Any, configured: float | None) -> float:
    """The weight of a mixture-of-experts model's load-balancing loss in the GRPO loss; 0: none.

    A model is mixture-of-experts when its (text) config has `output_router_logits`. Its weight
    is `configured`, or the config's `router_aux_loss_coef` (0.0 if it has none) when None.

    Raises:
        ValueError: A non-zero weight is configured for a model without experts.
    """
    text_config = model.config.get_text_config()
    with_experts = hasattr(text_config, "output_router_logits")
    if configured and not with_experts:
        raise ValueError(
            f"router_aux_loss_coef={configured} but {type(model).__name__} is not a "
            "mixture-of-experts model (its config has no output_router_logits), so there is no "
            "load-balancing loss to weight; leave router_aux_loss_coef unset"
        )
    if configured is None:
        configured = getattr(text_config, "router_aux_loss_coef", 0.0)
    return float(configured or 0.0) if with_experts else 0.0


def load_tokenizer(model: Any, processing_class: Any = None) -> Any:
    """The tokenizer to use: the one given, else the model's own, with a pad token set."""
    if processing_class is None:
        name = getattr(model, "name_or_path", None) or model.config._name_or_path
        processing_class = AutoTokenizer.from_pretrained(name)
    if processing_class.pad_token is None:
        processing_class.pad_token = processing_class.eos_token
    return processing_class


def reference_model(model: Any, args: Any) -> Any | None:
    """A frozen copy of the starting policy, needed only when `beta > 0`.

    With PEFT there is no copy: the reference is the base model with the adapter disabled.
    """
    if args.beta == 0.0 or _is_peft(model):
        return None
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0, so two forward passes give the same logprobs."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def cast_lm_head_to_fp32(model: Any) -> None:
    """Compute the output projection in float32 (ScaleRL); needs an untied head."""
    if model.config.get_text_config().tie_word_embeddings:
        raise ValueError(
            "cast_lm_head_to_fp32 needs a model whose lm_head is not tied to its input "
            "embeddings (tie_word_embeddings=False); this one ties them"
        )
    head = model.get_output_embeddings()
    head.float()
    head.register_forward_pre_hook(lambda _, args: (args[0].float(),))


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


class SyncReference(TrainerCallback):
    """`sync_ref_model`: every `every` steps, ref <- alpha * policy + (1 - alpha) * ref (TR-DPO).

    Args:
        reference: The reference model (a separate copy; PEFT runs have none to sync).
        policy: The model being trained.
        alpha: `ref_model_mixup_alpha`.
        every: `ref_model_sync_steps`.
    """

    def __init__(
        self, reference: torch.nn.Module, policy: torch.nn.Module, alpha: float, every: int
    ):
        self.reference, self.policy, self.alpha, self.every = reference, policy, alpha, every

    @torch.no_grad()
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Mix the policy into the reference on every `every`-th optimizer step."""
        if state.global_step % self.every:
            return
        for ref, current in zip(self.reference.parameters(), self.policy.parameters(), strict=True):
            ref.mul_(1.0 - self.alpha).add_(current.detach().to(ref.dtype), alpha=self.alpha)


def reference_sync(reference: torch.nn.Module | None, policy: Any, args: Any) -> SyncReference:
    """The `sync_ref_model` callback of a run.

    Raises:
        ValueError: There is no separate reference model (PEFT: the base model is the reference).
    """
    if reference is None:
        raise ValueError(
            "sync_ref_model mixes the policy into a separate reference model, but with PEFT "
            "the reference is the base model under the adapter; turn sync_ref_model off"
        )
    return SyncReference(reference, policy, args.ref_model_mixup_alpha, args.ref_model_sync_steps)
