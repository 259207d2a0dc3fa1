"""`GRPOConfig` fields that size the data: groups, batches, padding; and the batch arithmetic.

`resolve_batches` derives `steps_per_generation` and `generation_batch_size` from each other and
checks that a generation batch holds whole groups; `check_eval_batch` does the same for eval.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig

MAX_BATCH = 2**16
"""The most episodes one generation batch (one step's rounds) may hold.

Every episode of the batch (its tokens, logprobs and messages) is in memory at once, and the
sampler lists every row index of it; far larger batches than any published GRPO run uses
(thousands of episodes per step) exhaust memory instead of failing.
"""


@dataclass
class BatchingFields:
    """Group size, completion budget, generation batch and padding."""

    num_generations: int = field(
        default=8,
        metadata={
            "help": "Completions (episodes) sampled per prompt: the group size G. At least 2; "
            "the generation batch must be a multiple of it."
        },
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Group size during evaluation. None: num_generations."},
    )
    max_completion_length: int | None = field(
        default=512,
        metadata={
            "help": "Token budget of one completion; for an episode, model and tool turns together."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "Under DeepSpeed ZeRO-3, gather the full weights to generate: faster, but "
            "the model must fit on one GPU. False is incompatible with vLLM, and with more "
            "than one process (every forward pass would wait for every process)."
        },
    )
    shuffle_dataset: bool | None = field(
        default=True, metadata={"help": "Shuffle the training dataset."}
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad prompt and completion ids to a multiple of this. 'auto': 128 on AWS "
            "Neuron (which compiles once per shape), no padding elsewhere."
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Train on each micro-batch's episodes packed into one sequence, without "
            "padding: position ids restart at 0 per episode row and attention stays within it; "
            "rows sharing a prompt still run it once. Same losses and gradients as the padded "
            "forward. Not with FSDP2/ZeRO-3, images, or non-attention (recurrent) layers."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions generated at once, across all processes. None: "
            "per_device_train_batch_size * world_size * steps_per_generation. Exclusive with "
            "steps_per_generation."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-steps trained on each generation batch. None: "
            "gradient_accumulation_steps (or derived from generation_batch_size)."
        },
    )


def resolve_batches(config: "GRPOConfig") -> None:
    """Derive `steps_per_generation` and `generation_batch_size` from each other."""
    global_batch = config.per_device_train_batch_size * config.world_size
    require(
        config.generation_batch_size is None or config.steps_per_generation is None,
        "'generation_batch_size' and 'steps_per_generation' can not be both configured at "
        "the same time: each determines the other; set only one of them.",
    )
    if config.generation_batch_size is not None:
        require(
            config.generation_batch_size % global_batch == 0,
            f"generation_batch_size ({config.generation_batch_size}) must be divisible by the "
            f"global batch size ({global_batch}), per_device_train_batch_size * world_size.",
        )
        config.steps_per_generation = config.generation_batch_size // global_batch
    else:
        if config.steps_per_generation is None:
            config.steps_per_generation = config.gradient_accumulation_steps
        config.generation_batch_size = global_batch * config.steps_per_generation
    require(
        config.generation_batch_size <= MAX_BATCH,
        f"the generation batch of {config.generation_batch_size} episodes "
        f"(per_device_train_batch_size={config.per_device_train_batch_size} x world_size="
        f"{config.world_size} x steps_per_generation={config.steps_per_generation}) is above "
        f"{MAX_BATCH}, the most agentgrpo holds in memory for one step; lower them.",
    )
    require(
        config.generation_batch_size % config.num_generations == 0,
        f"generation_batch_size ({config.generation_batch_size}) must be divisible by "
        f"num_generations ({config.num_generations}). It is per_device_train_batch_size="
        f"{config.per_device_train_batch_size} x world_size={config.world_size} x "
        f"steps_per_generation={config.steps_per_generation}: choose "
        "per_device_train_batch_size, gradient_accumulation_steps (or steps_per_generation, "
        "or generation_batch_size) so that it holds whole groups.",
    )


def check_eval_batch(config: "GRPOConfig") -> None:
    """When evaluating, check that the global eval batch holds whole eval groups."""
    if not config.do_eval or config.eval_strategy == "no":
        return
    group = config.num_generations_eval or config.num_generations
    batch = config.per_device_eval_batch_size * config.world_size
    require(
        batch % group == 0,
        f"The global eval batch size ({config.per_device_eval_batch_size} * {config.world_size}) "
        f"must be divisible by the number of generations used for evaluation ({group}): "
        "choose per_device_eval_batch_size or num_generations_eval so that it holds whole "
        "groups.",
    )
