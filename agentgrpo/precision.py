"""The precision a run trains and generates in, and when the sampler's numerics need correcting.

Weights stay in the dtype they were loaded in (float32 from `agentgrpo run`, eval and doctor:
the optimizer's master copy; pure-bf16 AdamW at lr 1e-5 loses most updates to rounding, since a
bf16 weight near 1 cannot move by less than 2^-8); DeepSpeed in bf16 is the exception: its
module computes in bf16 and its optimizer keeps the float32 master copy. With mixed precision
(`bf16` or `fp16`, as set, as an `accelerate launch` asked, or bf16 by default on a GPU that
supports it) every forward pass runs under autocast in that dtype: the trainer's through
accelerate, generation through the backend's `autocast_dtype`, so generation and training read
the same weights in the same dtype; the learner's output layer, which runs outside the model's
forward (`learner.output_head`), runs in that autocast too (`GRPOTrainer.compute_loss`). They
still differ by kernel and batch shape (about 0.0015 nats a token in bf16 on a GPU), the gap
that `vllm_importance_sampling_correction` corrects, as it does for vLLM.
"""

from __future__ import annotations

from typing import Protocol

import torch

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionFlags(Protocol):
    """The fields of a `GRPOConfig` the precision is read from (config/ imports this module)."""

    @property
    def bf16(self) -> bool | None:
        """Train in bfloat16 mixed precision."""
        ...

    @property
    def fp16(self) -> bool | None:
        """Train in float16 mixed precision."""
        ...


class SamplerFlags(PrecisionFlags, Protocol):
    """`PrecisionFlags` and the fields that say whether the sampler's numerics are corrected."""

    @property
    def use_vllm(self) -> bool:
        """Whether vLLM generates."""
        ...

    @property
    def vllm_importance_sampling_correction(self) -> bool:
        """Correct the sampler's numerics (TRL's default True)."""
        ...


def mixed_precision_dtype(args: PrecisionFlags) -> torch.dtype | None:
    """The autocast dtype a `GRPOConfig` trains under: bfloat16, float16, or None.

    transformers' `mixed_precision` where the config has one (the `bf16`/`fp16` flags, else
    the mixed precision `accelerate launch` set, which its `Accelerator` trains under), else
    the flags.

    Examples:
        >>> from types import SimpleNamespace
        >>> mixed_precision_dtype(SimpleNamespace(bf16=True, fp16=False))
        torch.bfloat16
        >>> mixed_precision_dtype(SimpleNamespace(bf16=False, fp16=False)) is None
        True
        >>> mixed_precision_dtype(SimpleNamespace(bf16=False, fp16=False, mixed_precision="fp16"))
        torch.float16

    """
    mode = getattr(args, "mixed_precision", None)
    if mode is None:
        mode = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    return _AUTOCAST.get(mode)


def corrects_sampler_mismatch(args: SamplerFlags) -> bool:
    """Whether the loss reweights tokens by the trainer/sampler ratio (`sampler_correction`).

    With `vllm_importance_sampling_correction` (TRL's default True), where the sampler's
    numerics differ from the trainer's: vLLM, or any generation under mixed precision (a
    `rollout_func`'s included). float32 generation with transformers computes what the trainer
    computes (to about 1e-6 nats) and is left alone, as in TRL.
    """
    differs = args.use_vllm or mixed_precision_dtype(args) is not None
    return bool(args.vllm_importance_sampling_correction and differs)


def describe_precision(weights: torch.dtype, autocast: torch.dtype | None) -> str:
    """One line for a start-up summary: the weights' dtype and the autocast dtype, if any.

    Examples:
        >>> describe_precision(torch.float32, torch.bfloat16)
        'bf16 mixed precision (float32 weights, bfloat16 compute)'
        >>> describe_precision(torch.float32, None)
        'float32'

    """
    weights_name = str(weights).removeprefix("torch.")
    if autocast is None or autocast == weights:
        return weights_name
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(autocast, str(autocast))
    compute = str(autocast).removeprefix("torch.")
    return f"{short} mixed precision ({weights_name} weights, {compute} compute)"


def autocast_kwargs(dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """`TransformersBackend`'s `autocast_dtype` argument, given only when there is one."""
    return {} if dtype is None else {"autocast_dtype": dtype}
