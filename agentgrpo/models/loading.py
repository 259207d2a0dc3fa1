"""Loading the policy, its tokenizer and the reference model, as GRPOTrainer's arguments allow."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from agentgrpo.devices import inference_autocast
from agentgrpo.models.attention import use_grouped_query_sdpa
from agentgrpo.models.sharded import fsdp2_copy, zero3_copy
from agentgrpo.placement import Placement
from agentgrpo.precision import mixed_precision_dtype
from rollout.images import is_vision_processor, load_processor

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

logger = logging.getLogger(__name__)


def policy_init_kwargs(args: GRPOConfig, quantization_config: Any = None) -> dict[str, Any]:
    """The keyword arguments the policy's `from_pretrained` gets, as TRL builds them.

    `args.model_init_kwargs` (copied), plus the trainer's `quantization_config`, plus
    `trust_remote_code` from the config and `dtype="auto"` unless model_init_kwargs sets them.

    Raises:
        ValueError: `quantization_config` is given both ways.

    Examples:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(model_init_kwargs={"revision": "v1"}, trust_remote_code=True)
        >>> policy_init_kwargs(args)
        {'revision': 'v1', 'trust_remote_code': True, 'dtype': 'auto'}

    """
    kwargs = dict(_init_kwargs(args))
    if quantization_config is not None:
        if "quantization_config" in kwargs:
            raise ValueError(
                "You set `quantization_config` both as a trainer argument and in "
                "`args.model_init_kwargs`. Please set it in only one place, preferably as a "
                "trainer argument."
            )
        kwargs["quantization_config"] = quantization_config
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("dtype", "auto")
    return kwargs


def reward_model_kwargs(args: GRPOConfig) -> dict[str, Any]:
    """`from_pretrained` arguments of reward models given by name.

    As in TRL: the policy's `model_init_kwargs` and `trust_remote_code` (never the trainer's
    quantization config).
    """
    kwargs = dict(_init_kwargs(args))
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def _init_kwargs(args: GRPOConfig) -> dict[str, Any]:
    """`args.model_init_kwargs`, {} when None.

    TrainingArguments parses JSON object text into a dict. Other text is not a valid value; it
    is not checked here, and fails where it is used (`dict`, `.get`), as it always has.
    """
    return args.model_init_kwargs or {}  # type: ignore[return-value]


def load_policy(
    model: str | PreTrainedModel,
    args: GRPOConfig,
    peft_config: Any = None,
    quantization_config: Any = None,
) -> Any:
    """The model to train: a hub id or local path is loaded, a model is used as given.

    A model on transformers' "sdpa" attention is switched to `models.attention`'s
    "sdpa_gqa", the same attention without copying grouped key-value heads on a CPU.

    Args:
        model: A hub id or local folder (a vision-language model's is loaded with
            `AutoModelForImageTextToText`), a `PreTrainedModel`, or a `PeftModel`.
        args: The `GRPOConfig` (`model_init_kwargs`, `trust_remote_code`, `disable_dropout`,
            `cast_lm_head_to_fp32`, `gradient_checkpointing`).
        peft_config: A PEFT config; the model is wrapped with it (LoRA and friends).
        quantization_config: E.g. a `BitsAndBytesConfig`, for loading `model` by name.

    Loading arguments for a model that is already loaded are ignored with TRL's warnings.

    Raises:
        ValueError: A `PeftModel` comes with a `peft_config` (TRL refuses it too).
    """
    policy: Any = model  # a PreTrainedModel, a PeftModel, or loaded from a name just below
    if isinstance(model, str):
        policy = _auto_class(model, args).from_pretrained(
            model, **policy_init_kwargs(args, quantization_config)
        )
    else:
        _warn_unused_loading_arguments(args.model_init_kwargs, quantization_config)
    if peft_config is not None and _is_peft(policy):
        raise ValueError(
            "You passed a `PeftModel` instance together with a `peft_config` to the trainer. "
            "Please first merge and unload the existing adapter, save the resulting base model, "
            "and then pass that base model along with the new `peft_config` to the trainer."
        )
    if peft_config is not None:
        from peft import get_peft_model

        policy = get_peft_model(policy, peft_config)
    use_grouped_query_sdpa(policy)
    if args.disable_dropout:
        disable_dropout(policy)
    if args.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(policy)
    if args.gradient_checkpointing and hasattr(policy, "enable_input_require_grads"):
        policy.enable_input_require_grads()  # checkpointed LoRA needs grads at the inputs
    return policy


def _auto_class(name: str, args: GRPOConfig) -> Any:
    """Transformers' auto class for `name`: image-text-to-text for a VLM, else causal LM."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    revision = _init_kwargs(args).get("revision")
    config = AutoConfig.from_pretrained(
        name, trust_remote_code=args.trust_remote_code, revision=revision
    )
    vision = getattr(config, "vision_config", None) is not None
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def _warn_unused_loading_arguments(
    model_init_kwargs: dict[str, Any] | str | None, quantization_config: Any
) -> None:
    """TRL's warnings for loading arguments given with a model that is already loaded."""
    if model_init_kwargs is not None:
        logger.warning(
            "You passed `model_init_kwargs` to the `GRPOConfig`, but your model is already "
            "instantiated. The `model_init_kwargs` will be ignored."
        )
    if quantization_config is not None:
        logger.warning(
            "You passed `quantization_config` to the trainer, but your model is already "
            "instantiated. The `quantization_config` will be ignored."
        )


def load_for_generation(path: str, device: torch.device) -> tuple[Any, torch.dtype | None]:
    """A saved model to play episodes with (`agentgrpo eval`, `doctor --generate`), on `device`.

    As a training run holds it: float32 weights, on `models.attention`'s "sdpa_gqa" where it
    uses "sdpa". Returns the model (in eval mode) and the autocast dtype to generate under
    (`devices.inference_autocast`: bf16 on a GPU that supports it, None on a CPU). A
    vision-language model loads with `AutoModelForImageTextToText`.

    A PEFT adapter folder (`adapter_base`) loads as a `PeftModel`: the base model its
    adapter_config.json names, its adapter as PEFT's "default", and each named adapter saved
    in a subfolder (`named_adapters`) under its folder's name, the default one active.
    """
    from transformers import AutoModelForImageTextToText

    base = adapter_base(path)
    auto = AutoModelForImageTextToText if is_vision_folder(path) else AutoModelForCausalLM
    model: Any = auto.from_pretrained(base or path, dtype=torch.float32)
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path)
        for name in named_adapters(path):
            model.load_adapter(str(Path(path) / name), adapter_name=name)
        model.set_adapter("default")
    model = model.to(device).eval()
    use_grouped_query_sdpa(model)
    return model, inference_autocast(device)


ADAPTER_CONFIG = "adapter_config.json"  # what PEFT's save_pretrained writes beside an adapter


def adapter_base(path: str) -> str | None:
    """The base model of the PEFT adapter saved in folder `path`; None if `path` holds none.

    The base is adapter_config.json's `base_model_name_or_path`, as GRPOTrainer's
    `save_model` of a `peft_config` run writes it (the `--model` the run trained).

    Raises:
        ValueError: adapter_config.json names no base model.
    """
    config = Path(path) / ADAPTER_CONFIG
    if not config.is_file():
        return None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{config} names no base model (base_model_name_or_path); add the hub id or folder "
            "of the model the adapter was trained on"
        )
    return str(base)


def named_adapters(path: str) -> list[str]:
    """The named adapters beside the "default" one in adapter folder `path`, sorted.

    PEFT's `save_pretrained` writes each adapter but "default" to a subfolder of its name
    (`training.seat_policies`' ``"adapter:NAME"`` seats).
    """
    folders = Path(path).iterdir() if Path(path).is_dir() else ()
    return sorted(f.name for f in folders if (f / ADAPTER_CONFIG).is_file())


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
            f"`router_aux_loss_coef` is set to {configured} but {type(model).__name__} is not a "
            "Mixture-of-Experts model that returns its router logits, so there is no auxiliary "
            "loss to weight (its config has no output_router_logits); leave it unset."
        )
    if configured is None:
        configured = getattr(text_config, "router_aux_loss_coef", 0.0)
    return float(configured or 0.0) if with_experts else 0.0


#: The padding and truncation sides of a tokenizer or processor the trainer loads itself (TRL's).
TRAINER_SIDES = {"padding_side": "left", "truncation_side": "left"}


def load_tokenizer(
    model: Any, processing_class: Any = None, load_kwargs: dict[str, Any] | None = None
) -> Any:
    """The tokenizer to use: the one given, else the model's own, with a pad token set.

    The model's own pads and truncates on the left, as TRL loads it (`TRAINER_SIDES`), so a
    script that batch-generates with `trainer.processing_class` pads its prompts as there.

    Args:
        model: The policy (its name or path locates the tokenizer).
        processing_class: A tokenizer to use as it is, or None.
        load_kwargs: Passed to `AutoTokenizer.from_pretrained` (e.g. `trust_remote_code`,
            `revision`).
    """
    if processing_class is None:
        name = getattr(model, "name_or_path", None) or model.config._name_or_path
        kwargs = TRAINER_SIDES | (load_kwargs or {})
        processing_class = AutoTokenizer.from_pretrained(name, **kwargs)
    if processing_class.pad_token is None:
        processing_class.pad_token = processing_class.eos_token
    return processing_class


def reference_model(
    model: Any, args: GRPOConfig, placement: Placement | None = None, accelerator: Any = None
) -> Any | None:
    """A frozen copy of the starting policy, needed only when `beta > 0`.

    The copy is in the policy's dtype, on the run's device (`args.device`): under DeepSpeed and
    FSDP the Trainer leaves the policy on the CPU until `accelerator.prepare` moves it, and the
    copy is never prepared. A policy spread over devices (`device_map`) is copied as it is
    spread. The copy's logprobs run under the same autocast as the policy's. DeepSpeed takes
    no autocast: in bf16 or fp16 it casts the policy's parameters to that dtype when it
    prepares it (its buffers, such as rotary frequencies, stay as loaded), and the copy's are
    cast alike, so the two agree exactly until the first update.
    With PEFT there is no copy: the reference is the base model with the adapter disabled.
    Under DeepSpeed ZeRO-3 and FSDP2 (the run's `placement` says which; FSDP2 shards the copy
    with the run's `accelerator`) the copy is sharded as the policy is, as TRL's is: a DeepSpeed
    engine (`sharded.zero3_copy`), or FSDP2 modules (`sharded.fsdp2_copy`).
    """
    if args.beta == 0.0 or _is_peft(model):
        return None
    placement = placement or Placement()
    if placement.deepspeed_config is not None and placement.zero_stage == 3:
        return zero3_copy(model, placement.deepspeed_config)
    if placement.fsdp2:
        return fsdp2_copy(model, accelerator)
    reference = copy.deepcopy(model)
    if placement.uses_deepspeed and (dtype := mixed_precision_dtype(args)) is not None:
        for parameter in reference.parameters():
            if parameter.is_floating_point():
                parameter.data = parameter.data.to(dtype)
    if not getattr(model, "hf_device_map", None):
        reference.to(args.device)
    reference.eval().requires_grad_(False)
    return reference


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0, so two forward passes give the same logprobs."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def tokenizer_kwargs(args: GRPOConfig, model: Any) -> dict[str, Any]:
    """`AutoTokenizer.from_pretrained` arguments for the policy's own tokenizer.

    As in TRL: `trust_remote_code`, and the `revision` of `model_init_kwargs` when the policy
    was given by name.
    """
    revision = _init_kwargs(args).get("revision") if isinstance(model, str) else None
    return {"trust_remote_code": args.trust_remote_code, "revision": revision}


def cast_lm_head_to_fp32(model: Any) -> None:
    """Compute the output projection in float32 (ScaleRL), as TRL does.

    The head's weight becomes float32, and its forward casts its input to float32 and runs
    outside any autocast (which would compute it in bfloat16 again under mixed precision).
    When the head is tied to the input embeddings (Gemma, SmolLM2, ...) the tie is kept, so
    the shared weight is float32 too, and the embeddings' output is cast back to the weight's
    original dtype so that the rest of the model runs as before.

    Raises:
        ValueError: The head carries a PEFT adapter (TRL refuses it too).
    """
    head = model.get_output_embeddings()
    if _has_adapter(head):
        raise ValueError(
            "cast_lm_head_to_fp32=True is not supported when the lm_head carries a PEFT adapter "
            "(target_modules includes lm_head); remove lm_head from the adapter's target "
            "modules, or set cast_lm_head_to_fp32=False"
        )
    embeddings = model.get_input_embeddings()
    tied = embeddings is not None and embeddings.weight is head.weight
    original_dtype = head.weight.dtype
    head.float()
    head.__class__ = _float32_class(type(head))  # a class, not a hook: copies keep it
    if tied and original_dtype != torch.float32:
        embeddings.register_forward_hook(lambda _, args, output: output.to(original_dtype))


class _Float32Head(torch.nn.Module):
    """A head that casts its input to float32 and computes outside any autocast."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return super().forward(hidden.float(), *args, **kwargs)


def _float32_class(base: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """`base` computing in float32 (`_Float32Head` first in its method order)."""
    return type(f"Float32{base.__name__}", (_Float32Head, base), {})


def check_liger_kernel(args: GRPOConfig, model: Any) -> None:
    """Check `use_liger_kernel=True` before transformers' Trainer applies liger's kernels.

    As in TRL, only liger's layer kernels are applied (`fused_linear_cross_entropy` is set to
    False: the loss needs the logits), and a PEFT adapter on the output layer is refused.
    PEFT prompt-learning adapters are refused too (their virtual tokens never reach liger's
    kernels). Then, in TRL's order, a missing install is an ImportError; and liger-kernel's
    Triton kernels run only on a GPU, so a CPU run is refused; each with the fix.

    Raises:
        ValueError: An unsupported combination, or no GPU.
        ImportError: liger-kernel is not installed.
    """
    if not args.use_liger_kernel:
        return
    if _has_adapter(model.get_output_embeddings()):
        raise ValueError(
            "Applying a PEFT adapter to `lm_head` is not supported with use_liger_kernel=True: "
            "remove 'lm_head' from your target_modules"
        )
    adapter = getattr(model, "active_peft_config", None) if hasattr(model, "peft_config") else None
    if adapter is not None and adapter.is_prompt_learning:
        raise ValueError(
            "PEFT prompt-learning methods (prompt tuning, prefix tuning, p-tuning) are not "
            "supported with use_liger_kernel=True: their virtual tokens are added in the PEFT "
            "model's forward, which liger's kernels bypass; use LoRA or set use_liger_kernel=False"
        )
    config = dict(args.liger_kernel_config or {})
    if config.get("fused_linear_cross_entropy"):
        raise ValueError(
            '`liger_kernel_config={"fused_linear_cross_entropy": True}` is not supported: it '
            "replaces the model's forward and never returns the logits the GRPO loss needs; "
            "leave it out"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(
            "use_liger_kernel=True needs liger-kernel: pip install liger-kernel "
            "(or set use_liger_kernel=False)"
        )
    if args.device.type == "cpu":
        raise ValueError(
            "use_liger_kernel=True needs a GPU: liger-kernel's Triton kernels have no CPU "
            "backend (Triton finds no active driver on CPU). Train on a CUDA GPU, or set "
            "use_liger_kernel=False"
        )
    args.liger_kernel_config = {**config, "fused_linear_cross_entropy": False}


def _has_adapter(module: Any) -> bool:
    """Whether `module` is a PEFT tuner layer (LoRA, ...), i.e. carries an adapter."""
    if importlib.util.find_spec("peft") is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def load_policy_and_processing(
    model: Any,
    processing_class: Any,
    args: GRPOConfig,
    peft_config: Any,
    quantization_config: Any,
) -> tuple[Any, Any, Any]:
    """The policy to train (`load_policy`), its tokenizer, and its processor when it reads images.

    The tokenizer's loading arguments come from `model` as given (`tokenizer_kwargs`), and
    `use_liger_kernel` is checked on the loaded policy (`check_liger_kernel`). The processor is
    None for a text model (`tokenizer_and_processor`).
    """
    tokenizer_source = tokenizer_kwargs(args, model)
    model = load_policy(model, args, peft_config, quantization_config)
    check_liger_kernel(args, model)
    tokenizer, processor = tokenizer_and_processor(model, processing_class, tokenizer_source)
    return model, tokenizer, processor


def is_vision_model(model: Any) -> bool:
    """Whether `model`'s config has a vision tower (a `vision_config`)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def is_vision_folder(path: str) -> bool:
    """Whether the model saved at `path` (folder or hub id) has a vision tower.

    For a PEFT adapter folder, whether its base model has one (`adapter_base`).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(adapter_base(path) or path)
    return getattr(config, "vision_config", None) is not None


def tokenizer_and_processor(
    model: Any, processing_class: Any = None, load_kwargs: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """The policy's tokenizer, and its processor when it reads images (else None).

    Args:
        model: The loaded policy (its name or path locates what is not given).
        processing_class: A tokenizer, a VLM's processor, or None: the model's own (its
            processor for a VLM, `rollout.images.load_processor`, which works without
            torchvision).
        load_kwargs: Passed to `from_pretrained` (`trust_remote_code`, `revision`).
    """
    if processing_class is None and is_vision_model(model):
        name = getattr(model, "name_or_path", None) or model.config._name_or_path
        processing_class = load_processor(name, **(TRAINER_SIDES | (load_kwargs or {})))
    if not is_vision_processor(processing_class):
        return load_tokenizer(model, processing_class, load_kwargs), None
    tokenizer = load_tokenizer(model, processing_class.tokenizer)
    return tokenizer, processing_class
