"""`GRPOConfig`: every knob of a GRPO run, composed from its field groups, checked once.

The fields, their types and their defaults are those of TRL 1.x's `GRPOConfig`, so a TRL script
ports by changing its import; agentgrpo's own additions come last. Each group of fields lives in
the module named for its concern, in TRL's order: `model`, `batching`, `generation`, `vllm`,
`loss` (with the off-policy corrections), `episodes` (TRL's tool-calling bound first), `logs`,
`generation` again (TRL's engines agentgrpo lacks), then agentgrpo's `episodes`,
`warm_start` and `asynchronous`. Every value left open (`bf16`, `epsilon_high`, the batch sizes,
`pad_to_multiple_of`) is resolved here, so what `to_dict()` saves is what the run used.

Decisions that differ from TRL, each for a reason given where it is made:

- `bf16=None` follows a mixed precision `accelerate launch` asked for (bf16 or fp16); otherwise
  it means bf16 only on a CUDA GPU that supports it; on CPU, float32.
- `sync_ref_model=True` with `beta=0.0` is rejected here rather than by the trainer.
- Features agentgrpo lacks (transformers continuous batching, vLLM colocated
  over several processes or tensor-parallel) are refused, never silently ignored.
- An unknown keyword is a `TypeError` that names the nearest valid field.
"""

import difflib
import functools
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import TrainingArguments

from agentgrpo.config.asynchronous import AsyncFields, check_async
from agentgrpo.config.batching import BatchingFields, check_eval_batch, resolve_batches
from agentgrpo.config.checks import check_combinations, check_numbers, check_values, normalize
from agentgrpo.config.context import ContextFields, check_context
from agentgrpo.config.episodes import EpisodeFields, ToolCallingFields
from agentgrpo.config.generation import GenerationFields, OtherGeneratorFields
from agentgrpo.config.logs import LoggingFields
from agentgrpo.config.loss import LossFields, OffPolicyFields
from agentgrpo.config.model import ModelFields
from agentgrpo.config.sampling import SamplingFields, check_sampling
from agentgrpo.config.vllm import VLLMFields
from agentgrpo.config.warm_start import WarmStartFields
from agentgrpo.devices import name_deepspeed_accelerator, skip_unused_deepspeed_build


# The field groups, last first: a dataclass lays out its bases' fields from the last base to the
# first, so TrainingArguments' fields come first and agentgrpo's own last, as in TRL.
@dataclass
class GRPOConfig(
    ContextFields,
    SamplingFields,
    AsyncFields,
    WarmStartFields,
    EpisodeFields,
    OtherGeneratorFields,
    LoggingFields,
    ToolCallingFields,
    OffPolicyFields,
    LossFields,
    VLLMFields,
    GenerationFields,
    BatchingFields,
    ModelFields,
    TrainingArguments,
):
    """Configuration of a GRPO run: TRL 1.x's `GRPOConfig` fields plus agentgrpo's own.

    Every field is documented where it is defined (its `help` metadata, also shown by
    `HfArgumentParser`). After construction the derived values are filled in:
    `steps_per_generation`, `generation_batch_size`, `epsilon_high`, `bf16`,
    `pad_to_multiple_of`, and `scale_rewards` as a string.

    Raises:
        TypeError: For an unknown keyword argument (the message names the nearest field).
        ValueError: For a value or a combination of values that cannot work; the message says
            what to change.

    Examples:
        >>> config = GRPOConfig(
        ...     output_dir="runs/doctest", report_to="none",
        ...     per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        ... )
        >>> config.steps_per_generation, config.generation_batch_size
        (2, 8)
        >>> config.epsilon_high == config.epsilon, config.episode_max_turns
        (True, 512)

    """

    # Dict fields that also accept a JSON string from the command line (parsed by
    # `TrainingArguments.__post_init__`).
    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ]

    # --- TrainingArguments defaults that GRPO changes -------------------------------------------
    learning_rate: float = field(
        default=1e-6, metadata={"help": "Initial learning rate of the AdamW optimizer."}
    )
    logging_steps: float = field(
        default=10,
        metadata={
            "help": "Log every this many optimizer steps; a value below 1 is a fraction of the "
            "total number of steps."
        },
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "Recompute activations in the backward pass to save memory. Non-reentrant "
            "unless gradient_checkpointing_kwargs says use_reentrant=True, which also turns off "
            "the learner's shared-prompt forward (one pass over whole rows instead)."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={
            "help": "Drop dataset columns other than 'prompt', 'image' and 'images', as TRL "
            "does. Keep False when reward functions or environments read other columns."
        },
    )
    # None until __post_init__ resolves it, a bool from then on, as TrainingArguments expects.
    bf16: bool | None = field(  # type: ignore[assignment]
        default=None,
        metadata={
            "help": "Train in bf16 mixed precision. None: what `accelerate launch` asked for "
            "(--mixed_precision or the config's mixed_precision) when that is bf16 or fp16; "
            "otherwise True on a CUDA GPU that supports bf16 (and fp16 is off), else False: on "
            "CPU agentgrpo trains in float32, which is exact and, on the machines it is tested "
            "on, faster."
        },
    )

    def __post_init__(self) -> None:
        # bf16 must be a bool before TrainingArguments sees it: it rejects bf16 without a GPU.
        if self.bf16 is None:
            launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
            self.bf16 = default_bf16(self.fp16, self.use_cpu, launched)
        check_numbers(self)  # before TrainingArguments computes anything from them
        # Both before TrainingArguments (or accelerate) first imports DeepSpeed.
        name_deepspeed_accelerator(os.environ, torch.accelerator.current_accelerator(False))
        skip_unused_deepspeed_build(os.environ)
        super().__post_init__()
        normalize(self)
        check_values(self)
        check_combinations(self)
        resolve_batches(self)
        check_eval_batch(self)
        check_async(self)
        check_sampling(self)
        check_context(self)

    @property
    def episode_max_turns(self) -> int:
        """The most model turns an episode may take.

        `max_turns` when set, else `max_tool_calling_iterations + 1` (the tool-calling turns
        plus the answer), else a bound no episode reaches: every turn samples at least one
        token, so `max_completion_length` turns exhaust the token budget.
        """
        if self.max_turns is not None:
            return self.max_turns
        if self.max_tool_calling_iterations is not None:
            return self.max_tool_calling_iterations + 1
        return self.max_completion_length or 2**31 - 1


def default_bf16(fp16: bool, use_cpu: bool, launched: str | None = None) -> bool:
    """What `bf16=None` means: the launch's mixed precision, else bf16 on a CUDA GPU that has it.

    `launched` is the mixed precision `accelerate launch` set for the process
    (`ACCELERATE_MIXED_PRECISION`: "bf16", "fp16", "no", or None without a launch). A launch
    that asked for bf16 gets it, on CPU processes too: transformers would train under the
    launch's autocast all the same, while generation, the sampler correction and a DeepSpeed
    config (which refuses `bf16=False` against its own `bf16.enabled`) read this flag. An fp16
    launch gets False. Otherwise, on CPU training stays float32, which on these machines is
    both faster and exact.

    Examples:
        >>> default_bf16(fp16=False, use_cpu=True, launched="bf16")
        True
        >>> default_bf16(fp16=False, use_cpu=True, launched="no")
        False

    """
    if fp16 or launched == "fp16":
        return False
    return launched == "bf16" or (not use_cpu and _cuda_bf16_available())


def _cuda_bf16_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _reject_unknown_keywords(init):
    """Wrap a dataclass `__init__` so that a mistyped keyword names the nearest field."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        known = {f.name for f in fields(self) if f.init}
        for key in sorted(kwargs.keys() - known):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise TypeError(f"{type(self).__name__} got an unknown argument {key!r}{hint}")
        init(self, *args, **kwargs)

    return __init__


# Replacing a method is what this means to do: wrap the __init__ the dataclass made.
GRPOConfig.__init__ = _reject_unknown_keywords(GRPOConfig.__init__)  # type: ignore[method-assign]
